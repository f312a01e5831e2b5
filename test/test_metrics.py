"""The figure recorder and the Prometheus exporter, without ROS.

Real sockets and a real HTTP client: the exporter is scraped over loopback and parsed with
prometheus_client's own parser.
"""
import math
import socket
import threading
import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
import pytest

from edge_llm_ros.metrics import figures as fig
from edge_llm_ros.metrics.exporter import (FiguresCollector, MetricsError, MetricsPortInUseError,
                                           MetricsServer, MetricsSettings)
from edge_llm_ros.metrics.figures import FigureRecorder, Gauges, HistogramSnapshot
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings


def result(tokens=10, stop=StopReason.LENGTH, ttft=0.03, tps=120.0, wait=0.002):
    return GenerationResult(text='x' * tokens, token_ids=list(range(tokens)), stop_reason=stop,
                            prompt_tokens=5, completion_tokens=tokens,
                            timings=Timings(queue_wait_s=wait, time_to_first_token_s=ttft,
                                            decode_tokens_per_second=tps))


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, suffix=''):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
            if s.name == family.name + suffix}


def test_histogram_buckets_are_less_or_equal_and_end_with_inf():
    recorder = FigureRecorder()
    for ttft in (0.01, 0.0100001, 0.2, 99.0):   # on a bound, just above it, middle, beyond
        recorder.goal_ended(fig.SUCCEEDED, 'stop', result(ttft=ttft), 1.0, queued=True)
    snap = recorder.snapshot().ttft_s
    cumulative = dict(snap.cumulative())
    assert cumulative[0.01] == 1 and cumulative[0.025] == 2 and cumulative[0.25] == 3
    assert cumulative[30.0] == 3 and cumulative[math.inf] == 4 == snap.count
    assert snap.total == pytest.approx(0.01 + 0.0100001 + 0.2 + 99.0)


def test_quantile_interpolates_like_histogram_quantile():
    snap = HistogramSnapshot(bounds=(1.0, 2.0, 4.0), counts=(10, 10, 0, 0))
    assert snap.quantile(0.5) == pytest.approx(1.0)     # rank 10: top of the first bucket
    assert snap.quantile(0.75) == pytest.approx(1.5)    # rank 15: half-way through (1, 2]
    assert snap.quantile(0.25) == pytest.approx(0.5)    # first bucket starts at 0
    beyond = HistogramSnapshot(bounds=(1.0, 2.0), counts=(0, 0, 3))
    assert beyond.quantile(0.99) == 2.0                 # +Inf: the highest finite bound
    assert HistogramSnapshot(bounds=(1.0,), counts=(0, 0)).quantile(0.5) is None


def test_which_goal_feeds_which_figure():
    recorder = FigureRecorder()
    recorder.goal_ended(fig.SUCCEEDED, 'length', result(), 0.5, queued=True)
    # One token: a TTFT but no decode rate.
    recorder.goal_ended(fig.SUCCEEDED, 'stop', result(tokens=1, tps=0.0, ttft=0.04), 0.1,
                        queued=True)
    # Cancelled while queued: a queue wait, no token.
    recorder.goal_ended(fig.CANCELED, 'cancelled',
                        result(tokens=0, stop=StopReason.CANCELLED, wait=0.3), 0.3,
                        queued=True)
    # Invalid at admission: never queued, only its duration.
    recorder.goal_ended(fig.ABORTED, 'invalid_request',
                        result(tokens=0, stop=StopReason.ERROR), 0.001, queued=False)
    # A generation error after some tokens: not a TTFT sample (the worker's old rule).
    recorder.goal_ended(fig.ABORTED, 'failed', result(tokens=3, stop=StopReason.ERROR), 0.2,
                        queued=True)
    recorder.goal_rejected(fig.REJECTED_QUEUE_FULL)
    recorder.goal_rejected(fig.REJECTED_NOT_ACTIVE)
    recorder.goal_rejected(fig.REJECTED_QUEUE_FULL)
    recorder.invalid_request()
    f = recorder.snapshot()
    assert f.duration_s.count == 5 and f.queue_wait_s.count == 4
    assert f.ttft_s.count == 2 and f.decode_tps.count == 1
    assert f.last_ttft_s == pytest.approx(0.04) and f.last_decode_tps == pytest.approx(120.0)
    assert f.outcome_count(fig.SUCCEEDED) == 2 and f.outcome_count(fig.ABORTED) == 2
    assert f.outcome_count(fig.CANCELED) == 1 and f.outcome_count(fig.REJECTED) == 3
    assert f.outcome_count(fig.REJECTED, fig.REJECTED_QUEUE_FULL) == 2
    assert f.goals[(fig.ABORTED, 'invalid_request')] == 1 and f.invalid_requests == 1
    with pytest.raises(ValueError, match='rejected'):
        recorder.goal_ended(fig.REJECTED, 'queue_full', result(), 0.1, queued=False)


def test_concurrent_goals_are_all_counted():
    recorder = FigureRecorder()

    def finish(n):
        for _ in range(n):
            recorder.goal_ended(fig.SUCCEEDED, 'stop', result(), 0.2, queued=True)
    threads = [threading.Thread(target=finish, args=(500,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    f = recorder.snapshot()
    assert f.outcome_count(fig.SUCCEEDED) == f.duration_s.count == f.ttft_s.count == 4000
    assert f.duration_s.total == pytest.approx(800.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@pytest.fixture
def served():
    recorder = FigureRecorder()
    gauges = Gauges(queue_waiting=2, queue_capacity=8, running=1, kv_used=300,
                    kv_capacity=2048, rss_bytes=123456789, soc_temp_c=61.5, throttled=True)
    calls = []

    def read_gauges():
        calls.append(1)
        return gauges
    server = MetricsServer(MetricsSettings(port=free_port()), FiguresCollector(recorder,
                                                                               read_gauges))
    server.start()
    yield server, recorder, calls
    server.stop()


def test_scrape_reports_the_recorder_and_the_gauges(served):
    server, recorder, calls = served
    recorder.goal_ended(fig.SUCCEEDED, 'stop', result(ttft=0.03, tps=150.0), 0.7, queued=True)
    recorder.goal_ended(fig.CANCELED, 'cancelled', result(ttft=0.06, tps=90.0), 1.7,
                        queued=True)
    recorder.goal_rejected(fig.REJECTED_QUEUE_FULL)
    gauge_reads = len(calls)
    families = scrape(server.port)
    assert len(calls) == gauge_reads + 1          # gauges are read per scrape, not before
    goals = samples(families['edge_llm_goals'], '_total')
    assert goals == {
        ('edge_llm_goals_total', (('outcome', 'canceled'), ('reason', 'cancelled'))): 1.0,
        ('edge_llm_goals_total', (('outcome', 'rejected'), ('reason', 'queue_full'))): 1.0,
        ('edge_llm_goals_total', (('outcome', 'succeeded'), ('reason', 'stop'))): 1.0}
    snap = recorder.snapshot()
    for name, hist in (('edge_llm_ttft_seconds', snap.ttft_s),
                       ('edge_llm_decode_tokens_per_second', snap.decode_tps),
                       ('edge_llm_queue_wait_seconds', snap.queue_wait_s),
                       ('edge_llm_goal_duration_seconds', snap.duration_s)):
        family = families[name]
        assert family.type == 'histogram'
        buckets = {float(s.labels['le']): s.value for s in family.samples
                   if s.name == name + '_bucket'}
        assert buckets == {bound: float(n) for bound, n in hist.cumulative()}
        assert list(samples(family, '_count').values()) == [2.0]
        assert list(samples(family, '_sum').values()) == [pytest.approx(hist.total)]
    value = {name: next(iter(samples(families['edge_llm_' + name]).values()))
             for name in ('queue_depth', 'queue_capacity', 'generating', 'kv_used_tokens',
                          'kv_capacity_tokens', 'kv_occupancy', 'rss_bytes',
                          'soc_temperature_celsius', 'throttled')}
    assert value == {'queue_depth': 2, 'queue_capacity': 8, 'generating': 1,
                     'kv_used_tokens': 300, 'kv_capacity_tokens': 2048,
                     'kv_occupancy': pytest.approx(300 / 2048), 'rss_bytes': 123456789,
                     'soc_temperature_celsius': 61.5, 'throttled': 1}


def test_own_registry_never_the_global_one(served):
    server, _, _ = served
    assert server.registry is not REGISTRY
    assert REGISTRY.get_sample_value('edge_llm_throttled') is None
    assert server.registry.get_sample_value('edge_llm_throttled') == 1.0


def test_no_temperature_sample_without_a_reading():
    server = MetricsServer(MetricsSettings(port=free_port()),
                           FiguresCollector(FigureRecorder(), Gauges))
    server.start()
    try:
        families = scrape(server.port)
    finally:
        server.stop()
    assert families['edge_llm_soc_temperature_celsius'].samples == []
    assert samples(families['edge_llm_throttled']) == {('edge_llm_throttled', ()): 0.0}


def test_port_in_use_names_the_port_and_the_parameter():
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(MetricsSettings(port=port),
                               FiguresCollector(FigureRecorder(), Gauges))
        with pytest.raises(MetricsPortInUseError, match=f'metrics.port {port} is already in '
                           'use on 127.0.0.1.*metrics.port to 0'):
            server.start()
    # Freed by its owner: the same port binds now, and stop() frees it again.
    server.start()
    assert server.port == port
    server.stop()
    server.stop()   # idempotent
    with socket.socket() as again:
        again.bind(('127.0.0.1', port))


def test_unbindable_host_is_refused_with_the_parameter():
    server = MetricsServer(MetricsSettings(port=free_port(), host='203.0.113.7'),
                           FiguresCollector(FigureRecorder(), Gauges))
    with pytest.raises(MetricsError, match="metrics.host '203.0.113.7'"):
        server.start()


def test_settings_from_parameters():
    settings = MetricsSettings.from_params({'metrics.port': 9108, 'metrics.host': '0.0.0.0'})
    assert settings.enabled and settings.port == 9108 and settings.host == '0.0.0.0'
    assert not MetricsSettings.from_params({'metrics.port': 0,
                                            'metrics.host': '127.0.0.1'}).enabled
