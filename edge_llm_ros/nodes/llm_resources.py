"""What llm_node's on_configure builds and on_cleanup frees, as one object.

A configured node has a Configured: the engine worker (which loads the model on its own
thread), the thermal governor and its throttle, the resolver of the goals' tensor handles,
the CPU masks to restore, and the /metrics server. `configure` builds all of it or nothing
(ConfigureFailed says why); `release` frees it in the reverse order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import functools
from typing import Any, Callable, Optional

from edge_llm_ros.bringup import affinity
from edge_llm_ros.bringup.thermal import ThermalGovernor, ThermalSettings, ThrottleApplier
from edge_llm_ros.errors import EngineError
from edge_llm_ros.metrics.exporter import (FiguresCollector, MetricsError, MetricsServer,
                                           MetricsSettings)
from edge_llm_ros.metrics.figures import FigureRecorder, Gauges
from edge_llm_ros.nodes.embeddings import EmbeddingResolver
from edge_llm_ros.nodes.llm_config import LLMNodeConfig
from edge_llm_ros.runtime.lora_adapter import is_converted
from edge_llm_ros.serving.backends import engine_factory
from edge_llm_ros.serving.goal import CancelReason
from edge_llm_ros.serving.worker import EngineWorker


class ConfigureFailed(RuntimeError):
    """on_configure could not build the node's resources; the message says why."""


@dataclass
class Configured:
    """What on_configure builds and cleanup drops, as one: a node is configured or not."""

    config: LLMNodeConfig
    worker: EngineWorker            # owns the engine (created on the worker thread)
    governor: ThermalGovernor
    throttle: ThrottleApplier
    embeddings: EmbeddingResolver   # maps the goals' prefix_embeddings handles
    saved_affinity: dict            # CPU masks before engine.cpu_affinity pinned the process
    metrics: Optional[MetricsServer] = None   # /metrics (metrics.port 0: None)


def _pin_worker(cpus) -> None:
    """Pin the engine worker (decode) thread; runs first on that thread."""
    if cpus:
        affinity.pin_thread(cpus)


def configure(config: LLMNodeConfig, values: dict, figures: FigureRecorder,
              gauges: Callable[[], Gauges], log: Any) -> Configured:
    """Start /metrics, pin the process, load the engine; ConfigureFailed leaves nothing behind.

    `values` are the node's validated parameter values (/metrics).
    """
    engine_config = config.engine
    if config.remote is None and any(not is_converted(path) for _, path, _
                                     in engine_config.lora_adapters):
        # lora.adapters as users name them: converted once (cached). Only then does the node
        # load the converter (test_layers_node: a served node never imports it otherwise).
        from edge_llm_ros.convert.lora import convert_adapters
        try:
            engine_config = dataclasses.replace(engine_config, lora_adapters=convert_adapters(
                engine_config.lora_adapters, engine_config.model_dir))
        except EngineError as exc:
            raise ConfigureFailed(f'lora.adapters: {exc}') from None
    try:   # before the model loads: a taken port fails at once
        metrics = _start_metrics(MetricsSettings.from_params(values), figures, gauges, log)
    except MetricsError as exc:
        raise ConfigureFailed(str(exc)) from None
    governor = ThermalGovernor(config.thermal, config.engine.intra_op_threads or 1,
                               config.process_cpus)
    worker = EngineWorker(engine_factory(engine_config, config.remote), config.queue_depth,
                          config.runtime.feedback,
                          thread_setup=functools.partial(_pin_worker, config.decode_cpus),
                          pacer=governor)
    saved_affinity: dict = {}
    try:
        if config.process_cpus:
            # Before the engine exists, so every ORT thread starts inside the mask.
            saved_affinity = affinity.pin_process(config.process_cpus)
        worker.start()
    except Exception as exc:  # noqa: B902 - any load failure leaves the node unconfigured
        if saved_affinity:
            affinity.restore(saved_affinity)
        if metrics is not None:
            metrics.stop()
        raise ConfigureFailed(f'{type(exc).__name__}: {exc}') from None
    return Configured(config=config, worker=worker, governor=governor,
                      throttle=ThrottleApplier(config.process_cpus),
                      embeddings=EmbeddingResolver(), saved_affinity=saved_affinity,
                      metrics=metrics)


def _start_metrics(settings: MetricsSettings, figures: FigureRecorder,
                   gauges: Callable[[], Gauges], log: Any) -> Optional[MetricsServer]:
    """Serve /metrics until cleanup (None when metrics.port is 0); MetricsError if not."""
    if not settings.enabled:
        return None
    server = MetricsServer(settings, FiguresCollector(figures, gauges))
    server.start()
    log.info(f'Prometheus metrics on http://{settings.host}:{server.port}/metrics')
    return server


def release(configured: Configured, reason: CancelReason = CancelReason.SHUTDOWN) -> None:
    """Stop the worker (which ends every goal and closes the engine), then free the rest."""
    configured.worker.stop(reason)
    if configured.throttle.active:
        # A disabled governor's state never throttles: applying it restores the masks.
        configured.throttle.apply(ThermalGovernor(ThermalSettings(enabled=False), 1, ()).state)
    configured.embeddings.close()
    if configured.saved_affinity:
        affinity.restore(configured.saved_affinity)
    if configured.metrics is not None:
        configured.metrics.stop()
