"""llm_node's health: /diagnostics every diagnostics.period_s, the /metrics gauges, thermal.

Both /diagnostics and /metrics read the node's FigureRecorder and the same Gauges, so they
report the same figures. The thermal governor is polled by the diagnostics timer (a /metrics
scrape never reads sysfs nor changes the throttle).
"""
from __future__ import annotations

from typing import Any, Optional

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

from edge_llm_ros.metrics.figures import Gauges
from edge_llm_ros.nodes.diagnostics import build_status, NodeHealth


class Health:
    """Diagnostics publisher and gauges of one llm_node."""

    def __init__(self, node: Any, period_s: float) -> None:
        self._node = node
        self._group = MutuallyExclusiveCallbackGroup()
        self._pub = node.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._timer = node.create_timer(period_s, self.publish, callback_group=self._group)

    def _poll_thermal(self, configured: Any) -> Any:
        """Poll the governor, apply its core limit; return its state (None unconfigured)."""
        if configured is None:
            return None
        state = configured.governor.poll()
        configured.throttle.apply(state)
        return state

    def gauges(self) -> Gauges:
        """Queue, KV, memory and thermal figures now (diagnostics timer and /metrics scrape)."""
        node = self._node
        configured = node.configured
        worker = configured.worker if configured is not None else None
        engine = node.engine
        waiting = depth = running = 0
        if worker is not None:
            snap = worker.snapshot()
            waiting, depth, running = snap.waiting, snap.queue_depth, int(snap.running)
        kv_used, kv_capacity = engine.kv_occupancy() if engine is not None else (0, 0)
        thermal = configured.governor.state if configured is not None else None
        hottest = thermal.hottest if thermal is not None else None
        return Gauges(queue_waiting=waiting, queue_capacity=depth, running=running,
                      kv_used=kv_used, kv_capacity=kv_capacity,
                      rss_bytes=node.process.memory_info().rss,
                      soc_temp_c=hottest.celsius if hottest is not None else None,
                      throttled=thermal is not None and thermal.throttled)

    def health(self) -> NodeHealth:
        node = self._node
        configured = node.configured
        worker = configured.worker if configured is not None else None
        config = configured.config if configured is not None else None
        engine = node.engine
        thermal = self._poll_thermal(configured)   # first: the gauges read this poll
        extra = tuple(thermal.diagnostics().items()) if thermal is not None else ()
        gguf_name = getattr(getattr(engine, 'info', None), 'gguf_name', '')
        if gguf_name:   # `model` is the display name; this, the source's own name
            extra += (('gguf_name', gguf_name),)
        kernel = getattr(engine, 'kernel', '')
        if kernel:
            extra += (('kernel', kernel),)
        speculation = getattr(engine, 'speculation', None)
        if speculation is not None:
            mode = speculation.config.mode
            extra += (('speculative', mode if speculation.enabled or mode == 'off'
                       else f'{mode}: off ({speculation.why_off})'),)
        warm = engine.warm_prompts() if hasattr(engine, 'warm_prompts') else ()
        extra += (('warm_prompts', str(len(warm))),)
        extra += tuple((f'warm_prompt_{i}', f'{p.tokens} tokens, {p.nbytes} bytes, '
                        f'{p.status}: {p.label}') for i, p in enumerate(warm))
        rows: Optional[Any] = getattr(engine, 'rows', None)
        if rows is not None:
            extra += (('decode_rows_min', str(rows.min_rows)),
                      ('batched_equals_alone', str(rows.exact).lower()),
                      ('decode_rows_probe', rows.finding))
        return NodeHealth(
            node_name=node.get_fully_qualified_name(), state=node.lifecycle_state(),
            model=engine.model_name if engine else '',
            model_dir=engine.model_dir if engine else '',
            providers=','.join(engine.providers) if engine else '',
            queue_full=worker is not None and not worker.has_room(), gauges=self.gauges(),
            figures=node.figures.snapshot(), board=config.board if config is not None else '',
            warnings=config.warnings if config is not None else (), extra=extra,
            load_error=node.load_error,
            last_error=worker.stats.last_error if worker is not None else '')

    def publish(self) -> None:
        node = self._node
        msg = DiagnosticArray(status=[build_status(self.health())])
        msg.header.stamp = node.get_clock().now().to_msg()
        self._pub.publish(msg)
