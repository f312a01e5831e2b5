"""llm_node's /metrics, served by a real node process on the embedded SmolLM2.

The node runs goals that succeed, are cancelled, are invalid and are rejected; /metrics is
scraped over HTTP and parsed with prometheus_client's parser, and /diagnostics (real rclpy)
must report the same counts. The endpoint lives from configure to cleanup, and a second
node asking for the same port fails to configure with a message naming it, while the
first keeps serving.
"""
import os
import socket
import urllib.error
import urllib.request

from llm_node_harness import LONG_SCHEMA, NodeProcess, served, TRANSITIONS, wait_for
from prometheus_client.parser import text_string_to_metric_families
import pytest

from edge_llm_ros.client import InvalidGoalError, NodeInactiveError
from edge_llm_ros.metrics.figures import HistogramSnapshot

NODE = f'llm_node_metrics_{os.getpid()}'
SERVER = '/' + NODE
QUEUE_DEPTH = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


PORT = free_port()


def scrape(port: int = PORT) -> dict:
    with urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10) as answer:
        text = answer.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def goal_counts(families) -> dict:
    return {(s.labels['outcome'], s.labels['reason']): int(s.value)
            for s in families['edge_llm_goals'].samples if s.name == 'edge_llm_goals_total'}


def histogram(families, name) -> HistogramSnapshot:
    """Rebuild a scraped histogram as a snapshot (to compare with the diagnostics' P99)."""
    family = families['edge_llm_' + name]
    le = sorted((float(s.labels['le']), int(s.value)) for s in family.samples
                if s.name.endswith('_bucket'))
    counts = [le[0][1]] + [b[1] - a[1] for a, b in zip(le, le[1:])]
    total = next(s.value for s in family.samples if s.name.endswith('_sum'))
    return HistogramSnapshot(tuple(b for b, _ in le[:-1]), tuple(counts), total)


def gauge(families, name) -> float:
    family = families['edge_llm_' + name]
    assert len(family.samples) == 1, family
    return family.samples[0].value


@pytest.fixture(scope='module')
def ros():
    with served(NODE, {'autostart': True, 'metrics.port': PORT, 'max_tokens': 8,
                       'queue.depth': QUEUE_DEPTH},
                f'llm_node_metrics_client_{os.getpid()}') as client:
        yield client


@pytest.fixture(scope='module')
def llm(ros):
    return ros.llm(SERVER)


def test_scrape_counts_the_goals_like_diagnostics(ros, llm):
    assert goal_counts(scrape()) == {}       # up since configure, nothing ended yet
    ok = llm.generate('Name one color.', max_tokens=8).result(timeout=120)
    assert ok.ok and ok.completion_tokens > 1, ok
    busy = llm.generate('Count', max_tokens=2000, json_schema=LONG_SCHEMA)
    assert busy.accepted
    wait_for(lambda: gauge(scrape(), 'generating') == 1, 60, 'the busy goal to run')
    assert busy.cancel(timeout=30)
    cancelled = busy.result(timeout=120)
    assert cancelled.status == 'canceled', cancelled
    invalid = llm.generate('', max_tokens=8).result(timeout=120)
    with pytest.raises(InvalidGoalError):
        invalid.raise_for_error()

    families = scrape()
    assert goal_counts(families) == {('succeeded', ok.finish_reason): 1,
                                     ('canceled', 'cancelled'): 1,
                                     ('aborted', 'invalid_request'): 1}
    assert gauge(families, 'invalid_requests') == 1
    produced = 1 + (cancelled.completion_tokens > 0)
    counts = {name: histogram(families, name).count for name in (
        'goal_duration_seconds', 'queue_wait_seconds', 'ttft_seconds',
        'decode_tokens_per_second')}
    # Every accepted goal has a duration; the invalid one never reached the queue.
    assert counts['goal_duration_seconds'] == 3 and counts['queue_wait_seconds'] == 2
    assert counts['ttft_seconds'] == produced
    assert counts['decode_tokens_per_second'] == 1 + (cancelled.completion_tokens > 1)
    ttft = histogram(families, 'ttft_seconds')
    assert ttft.total >= ok.timings.time_to_first_token_s > 0
    assert gauge(families, 'queue_capacity') == QUEUE_DEPTH
    assert gauge(families, 'queue_depth') == 0 and gauge(families, 'generating') == 0
    assert gauge(families, 'kv_capacity_tokens') >= 512
    assert 50 * 2**20 < gauge(families, 'rss_bytes') < 4 * 2**30
    assert gauge(families, 'throttled') in (0, 1)

    # /diagnostics reports the same figures, from the same recorder.
    status = ros.next_status(SERVER)
    assert int(status['goals_succeeded']) == 1 and int(status['goals_cancelled']) == 1
    assert int(status['goals_aborted']) == 1 and int(status['invalid_requests']) == 1
    assert int(status['kv_capacity_tokens']) == gauge(families, 'kv_capacity_tokens')
    assert int(status['queue_depth']) == QUEUE_DEPTH
    assert float(status['ttft_p99_ms']) == pytest.approx(ttft.quantile(0.99) * 1e3, abs=0.06)
    duration = histogram(families, 'goal_duration_seconds')
    assert float(status['goal_duration_p99_ms']) == pytest.approx(
        duration.quantile(0.99) * 1e3, abs=0.06)
    temperature = families['edge_llm_soc_temperature_celsius'].samples
    if temperature:
        assert float(status['soc_temperature_c']) == pytest.approx(temperature[0].value,
                                                                   abs=0.06)
    else:
        assert status['soc_temperature_c'] == 'n/a'


def test_rejections_are_counted_and_metrics_live_until_cleanup(ros, llm):
    assert ros.transition(SERVER, TRANSITIONS['deactivate'])
    with pytest.raises(NodeInactiveError):
        llm.generate('Hi', max_tokens=2).result(timeout=60)
    families = scrape()          # still served while inactive
    assert goal_counts(families)[('rejected', 'unavailable')] == 1
    assert int(ros.next_status(SERVER)['rejected_not_active']) == 1
    assert ros.transition(SERVER, TRANSITIONS['cleanup'])
    with pytest.raises(urllib.error.URLError):
        scrape()                 # closed at cleanup
    assert ros.transition(SERVER, TRANSITIONS['configure'])
    assert goal_counts(scrape())[('rejected', 'unavailable')] == 1   # counts are the node's
    assert ros.transition(SERVER, TRANSITIONS['activate'])


def test_a_taken_port_fails_configure_and_the_first_node_keeps_serving(ros, llm):
    name = f'llm_node_metrics_taken_{os.getpid()}'
    second = NodeProcess(name, {'autostart': True, 'metrics.port': PORT})
    try:
        second.wait_output(f'metrics.port {PORT} is already in use', timeout=120)
        ros.wait_state('/' + name, 'unconfigured', timeout=60)
        status = ros.next_status('/' + name)
        assert f'metrics.port {PORT}' in status['load_error'] and status['level'] == 2
        assert 'configure failed' in second.log()
    finally:
        assert second.stop() == 0, second.log()
    before = goal_counts(scrape())
    ok = llm.generate('Name one color.', max_tokens=4).result(timeout=120)
    assert ok.ok, ok
    after = goal_counts(scrape())
    assert after[('succeeded', ok.finish_reason)] == before.get(
        ('succeeded', ok.finish_reason), 0) + 1


def test_a_failed_model_load_closes_the_endpoint(ros, tmp_path):
    name = f'llm_node_metrics_broken_{os.getpid()}'
    port = free_port()
    (tmp_path / 'model.onnx').write_bytes(b'not a model')
    broken = NodeProcess(name, {'autostart': True, 'metrics.port': port,
                                'model.path': str(tmp_path)})
    try:
        broken.wait_output('configure failed', timeout=120)
        assert 'Prometheus metrics on' in broken.log()    # it was up while loading
        with socket.socket() as again:                      # and is closed now
            again.bind(('127.0.0.1', port))
    finally:
        assert broken.stop() == 0, broken.log()
