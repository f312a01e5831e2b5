"""llm_node's /diagnostics status: one DiagnosticStatus built from a plain snapshot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from diagnostic_msgs.msg import DiagnosticStatus, KeyValue


@dataclass(frozen=True)
class NodeHealth:
    """Everything the status reports; gathered by the node once per period."""

    node_name: str
    state: str                      # lifecycle state label
    model: str = ''
    model_dir: str = ''
    providers: str = ''
    queue_waiting: int = 0
    queue_depth: int = 0
    running: bool = False
    queue_full: bool = False
    last_ttft_s: float = 0.0
    decode_tps: float = 0.0
    kv_used: int = 0
    kv_capacity: int = 0
    rss_bytes: int = 0
    soc_temp_c: Optional[float] = None
    soc_temp_warn: bool = False
    goals_succeeded: int = 0
    goals_cancelled: int = 0
    goals_aborted: int = 0
    rejected_inactive: int = 0
    rejected_queue_full: int = 0
    invalid_requests: int = 0
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
    if h.soc_temp_warn:
        return DiagnosticStatus.WARN, f'SoC hot ({h.soc_temp_c:.1f} C): generation throttled'
    return DiagnosticStatus.OK, 'generating' if h.running else 'ready'


def build_status(h: NodeHealth) -> DiagnosticStatus:
    level, message = level_and_message(h)
    occupancy = 100.0 * h.kv_used / h.kv_capacity if h.kv_capacity else 0.0
    values = [
        ('state', h.state), ('model', h.model), ('model_dir', h.model_dir),
        ('providers', h.providers), ('queue_waiting', str(h.queue_waiting)),
        ('queue_depth', str(h.queue_depth)), ('generating', str(h.running).lower()),
        ('last_ttft_ms', f'{h.last_ttft_s * 1e3:.1f}'),
        ('decode_tokens_per_second', f'{h.decode_tps:.1f}'),
        ('kv_used_tokens', str(h.kv_used)), ('kv_capacity_tokens', str(h.kv_capacity)),
        ('kv_occupancy_percent', f'{occupancy:.1f}'),
        ('rss_mb', f'{h.rss_bytes / 2**20:.1f}'),
        ('soc_temperature_c', 'n/a' if h.soc_temp_c is None else f'{h.soc_temp_c:.1f}'),
        ('goals_succeeded', str(h.goals_succeeded)),
        ('goals_cancelled', str(h.goals_cancelled)),
        ('goals_aborted', str(h.goals_aborted)),
        ('rejected_not_active', str(h.rejected_inactive)),
        ('rejected_queue_full', str(h.rejected_queue_full)),
        ('invalid_requests', str(h.invalid_requests)),
        ('load_error', h.load_error), ('last_error', h.last_error), ('board', h.board),
        ('configure_warnings', ' | '.join(h.warnings)),
        *h.extra,
    ]
    return DiagnosticStatus(level=level, name=f'{h.node_name}: llm engine', message=message,
                            hardware_id=h.model or 'none',
                            values=[KeyValue(key=k, value=v) for k, v in values])
