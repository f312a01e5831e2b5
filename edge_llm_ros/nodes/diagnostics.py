"""llm_node's /diagnostics status: one DiagnosticStatus built from a plain snapshot.

The goal counts, last TTFT / decode rate and the latency percentiles come from the same
FigureRecorder snapshot that /metrics serves (edge_llm_ros/metrics), and the queue, KV,
memory and temperature from the same Gauges: both report the same figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

from edge_llm_ros.metrics import figures as fig
from edge_llm_ros.metrics.figures import FigureRecorder, Figures, Gauges

_NO_FIGURES = FigureRecorder().snapshot()


@dataclass(frozen=True)
class NodeHealth:
    """Everything the status reports; gathered by the node once per period."""

    node_name: str
    state: str                      # lifecycle state label
    model: str = ''
    model_dir: str = ''
    providers: str = ''
    queue_full: bool = False
    gauges: Gauges = field(default_factory=Gauges)
    figures: Figures = _NO_FIGURES
    load_error: str = ''            # last on_configure failure (cleared by a successful one)
    last_error: str = ''            # last generation error
    board: str = ''
    warnings: tuple = ()            # configure-time (preflight) findings; level unaffected
    extra: tuple = ()               # more (key, value) pairs (thermal governor state)


def level_and_message(h: NodeHealth) -> tuple:
    """ERROR: the model failed to load. WARN: not serving, queue full, or hot. OK otherwise."""
    if h.load_error:
        return DiagnosticStatus.ERROR, 'model load failed: ' + h.load_error
    if h.state != 'active':
        return DiagnosticStatus.WARN, f'not serving ({h.state})'
    if h.queue_full:
        return DiagnosticStatus.WARN, 'queue full: new goals are rejected'
    if h.gauges.throttled:
        hot = h.gauges.soc_temp_c
        return DiagnosticStatus.WARN, f'SoC hot ({"?" if hot is None else f"{hot:.1f}"} C): ' \
            'generation throttled'
    return DiagnosticStatus.OK, 'generating' if h.gauges.running else 'ready'


def _ms(seconds: Optional[float]) -> str:
    return 'n/a' if seconds is None else f'{seconds * 1e3:.1f}'


def _percentiles(f: Figures) -> list:
    """P50/P99 estimated from the histograms, as PromQL's histogram_quantile would."""
    rate = f.decode_tps.quantile(0.5)
    return [
        ('ttft_p50_ms', _ms(f.ttft_s.quantile(0.5))),
        ('ttft_p99_ms', _ms(f.ttft_s.quantile(0.99))),
        ('queue_wait_p99_ms', _ms(f.queue_wait_s.quantile(0.99))),
        ('goal_duration_p99_ms', _ms(f.duration_s.quantile(0.99))),
        ('decode_tokens_per_second_p50', 'n/a' if rate is None else f'{rate:.1f}'),
    ]


def build_status(h: NodeHealth) -> DiagnosticStatus:
    level, message = level_and_message(h)
    g, f = h.gauges, h.figures
    values = [
        ('state', h.state), ('model', h.model), ('model_dir', h.model_dir),
        ('providers', h.providers), ('queue_waiting', str(g.queue_waiting)),
        ('queue_depth', str(g.queue_capacity)), ('generating', str(bool(g.running)).lower()),
        ('last_ttft_ms', f'{f.last_ttft_s * 1e3:.1f}'),
        ('decode_tokens_per_second', f'{f.last_decode_tps:.1f}'),
        *_percentiles(f),
        ('kv_used_tokens', str(g.kv_used)), ('kv_capacity_tokens', str(g.kv_capacity)),
        ('kv_occupancy_percent', f'{100.0 * g.kv_occupancy:.1f}'),
        ('rss_mb', f'{g.rss_bytes / 2**20:.1f}'),
        ('soc_temperature_c', 'n/a' if g.soc_temp_c is None else f'{g.soc_temp_c:.1f}'),
        ('goals_succeeded', str(f.outcome_count(fig.SUCCEEDED))),
        ('goals_cancelled', str(f.outcome_count(fig.CANCELED))),
        ('goals_aborted', str(f.outcome_count(fig.ABORTED))),
        ('rejected_not_active', str(f.outcome_count(fig.REJECTED, fig.REJECTED_NOT_ACTIVE))),
        ('rejected_queue_full', str(f.outcome_count(fig.REJECTED, fig.REJECTED_QUEUE_FULL))),
        ('invalid_requests', str(f.invalid_requests)),
        ('speculative_acceptance', f'{f.acceptance_rate:.3f}'),
        ('tokens_per_decode_step', f'{f.tokens_per_pass:.2f}'),
        ('speculative_verify_passes', str(f.draft_passes)),
        ('load_error', h.load_error), ('last_error', h.last_error), ('board', h.board),
        ('configure_warnings', ' | '.join(h.warnings)),
        *h.extra,
    ]
    return DiagnosticStatus(level=level, name=f'{h.node_name}: llm engine', message=message,
                            hardware_id=h.model or 'none',
                            values=[KeyValue(key=k, value=v) for k, v in values])
