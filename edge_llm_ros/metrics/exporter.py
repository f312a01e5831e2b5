"""Prometheus /metrics for llm_node: a collector over the FigureRecorder and the gauges.

Everything is built when Prometheus scrapes: the recorder's snapshot (counts, histograms)
and the node's `Gauges` (queue, KV, RSS, temperature), so the decode path never touches
prometheus_client. The collector lives in its own CollectorRegistry (never the global
one), so two nodes in one process, or a test, never share series.
"""
from __future__ import annotations

from dataclasses import dataclass
import errno
import math
import threading
from typing import Any, Callable, Dict, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from edge_llm_ros.metrics.figures import FigureRecorder, Gauges, HistogramSnapshot

PREFIX = 'edge_llm_'


class MetricsError(RuntimeError):
    """The /metrics endpoint could not start; the message names the parameter to change."""


class MetricsPortInUseError(MetricsError):
    """metrics.port is taken by another process."""


@dataclass(frozen=True)
class MetricsSettings:
    """metrics.port (0 = off) and metrics.host (127.0.0.1: this machine only)."""

    port: int = 0
    host: str = '127.0.0.1'

    @property
    def enabled(self) -> bool:
        return self.port != 0

    @classmethod
    def from_params(cls, values: Dict[str, Any]) -> 'MetricsSettings':
        return cls(port=int(values['metrics.port']), host=str(values['metrics.host']))


def _le(bound: float) -> str:
    return '+Inf' if math.isinf(bound) else repr(float(bound))


def _histogram(name: str, doc: str, snap: HistogramSnapshot) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        PREFIX + name, doc, sum_value=snap.total,
        buckets=[(_le(bound), count) for bound, count in snap.cumulative()])


class FiguresCollector:
    """prometheus_client custom collector: reads the recorder and the gauges per scrape."""

    def __init__(self, recorder: FigureRecorder, gauges: Callable[[], Gauges]) -> None:
        self._recorder = recorder
        self._gauges = gauges

    def collect(self) -> Iterator[Any]:
        figures = self._recorder.snapshot()
        gauges = self._gauges()
        goals = CounterMetricFamily(
            PREFIX + 'goals', 'Requests (goals and ~/complete calls) by how they ended: '
            'outcome succeeded|canceled|aborted|rejected; reason the finish reason, or the '
            'error kind of an aborted or rejected one', labels=('outcome', 'reason'))
        for (outcome, reason), count in sorted(figures.goals.items()):
            goals.add_metric((outcome, reason), count)
        yield goals
        yield CounterMetricFamily(
            PREFIX + 'invalid_requests', 'Requests of any interface refused for what they '
            'asked (diagnostics: invalid_requests)', value=figures.invalid_requests)
        for name, doc, value in (
                ('speculative_verify_passes', 'Verify passes of speculative decoding',
                 figures.draft_passes),
                ('speculative_drafted_tokens', 'Drafted tokens fed to verify passes',
                 figures.draft_tokens),
                ('speculative_accepted_tokens', 'Drafted tokens kept',
                 figures.accepted_draft_tokens),
                ('decode_steps', 'Model calls after the prompt (plain steps and verify passes)',
                 figures.decode_steps),
                ('decode_tokens', 'Tokens those model calls produced', figures.decode_tokens)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + 'speculative_acceptance_ratio', 'Accepted / drafted '
                                'tokens over ended goals (0 before any draft)',
                                value=figures.acceptance_rate)
        yield GaugeMetricFamily(PREFIX + 'tokens_per_decode_step', 'Decode tokens per model '
                                'call over ended goals (1 without speculation)',
                                value=figures.tokens_per_pass)
        yield _histogram('ttft_seconds', 'Time to first token inside the engine (prefill), '
                         'per request that produced a token', figures.ttft_s)
        yield _histogram('decode_tokens_per_second', 'Decode rate per request with two or '
                         'more tokens', figures.decode_tps)
        yield _histogram('queue_wait_seconds', 'Accepted -> started on the engine (or '
                         'cancelled while waiting)', figures.queue_wait_s)
        yield _histogram('goal_duration_seconds', 'Accepted -> terminal state, per accepted '
                         'request', figures.duration_s)
        for name, doc, value in (
                ('queue_depth', 'Goals waiting behind the running one', gauges.queue_waiting),
                ('queue_capacity', 'Goals allowed to wait (queue.depth; 0 = not configured)',
                 gauges.queue_capacity),
                ('generating', 'Goals generating now', gauges.running),
                ('kv_used_tokens', 'KV cache positions in use', gauges.kv_used),
                ('kv_capacity_tokens', 'KV cache positions available', gauges.kv_capacity),
                ('kv_occupancy', 'KV positions used / capacity (0..1)', gauges.kv_occupancy),
                ('rss_bytes', 'Resident memory of the node process', gauges.rss_bytes),
                ('throttled', '1 while the thermal governor slows generation down',
                 int(gauges.throttled))):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        temperature = GaugeMetricFamily(
            PREFIX + 'soc_temperature_celsius', 'Hottest watched thermal zone at the last '
            'diagnostics poll (no sample when none is readable)')
        if gauges.soc_temp_c is not None:
            temperature.add_metric((), gauges.soc_temp_c)
        yield temperature


class MetricsServer:
    """The HTTP endpoint, from start() to stop(); one per configured node."""

    def __init__(self, settings: MetricsSettings, collector: FiguresCollector) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self._server: Optional[Any] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        """Return the bound TCP port; 0 until started."""
        return self._server.server_address[1] if self._server is not None else 0

    def start(self) -> None:
        """Bind metrics.host:metrics.port and serve /metrics on a daemon thread.

        Raises MetricsPortInUseError (port taken) or MetricsError (host not bindable).
        """
        host, port = self.settings.host, self.settings.port
        try:
            self._server, self._thread = start_http_server(port, addr=host,
                                                           registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUseError(
                    f'metrics.port {port} is already in use on {host} ({exc.strerror}): '
                    'choose a free port, or set metrics.port to 0 to turn /metrics off'
                ) from None
            raise MetricsError(
                f'cannot serve /metrics on metrics.host {host!r}, metrics.port {port}: '
                f'{exc}; use an address of this machine (127.0.0.1 by default) and a free '
                'port, or set metrics.port to 0') from None
        self._thread.name = 'llm_metrics_http'

    def stop(self) -> None:
        """Close the socket and end the thread (idempotent)."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)
