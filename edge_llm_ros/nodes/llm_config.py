"""llm_node's parameters: declared from bringup's schema, read once into a typed config.

Declaring, reading and checking go through nodes/node_params.py, the one parameter path of
every node; this module turns llm_node's values into frozen dataclasses. Load-time
parameters are read_only and read in on_configure (a change needs cleanup + configure).
Request defaults (sampling, max_tokens, system_prompt) and the feedback cadence may change
at run time: check_changes refuses values outside the schema and a post-set callback
rebuilds the frozen RuntimeConfig the hot path reads, so no code re-queries parameters per
goal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from rclpy.node import Node

from edge_llm_ros.bringup import parameters as schema_mod
from edge_llm_ros.bringup.affinity import parse_cpu_list, plan_affinity
from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.preflight import preflight
from edge_llm_ros.bringup.thermal import ThermalSettings
from edge_llm_ros.nodes import node_params
from edge_llm_ros.nodes.messages import RequestDefaults
from edge_llm_ros.nodes.node_params import ConfigError
from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
from edge_llm_ros.runtime.types import SamplingConfig
from edge_llm_ros.serving.engine import EngineConfig
from edge_llm_ros.serving.goal import FeedbackPolicy
from edge_llm_ros.serving.remote import RemoteConfig

SCHEMA = schema_mod.schema('llm_node')

# on_set_parameters callback: refuses values outside the schema, with its message.
check_changes = node_params.change_checker(SCHEMA)


def declare_parameters(node: Node) -> None:
    """Declare llm_node's parameters (rclpy's exceptions for an override that does not fit)."""
    node_params.declare(node, SCHEMA)


def current_values(node: Node) -> Dict[str, Any]:
    """llm_node's parameter values by name, not validated (see read_config)."""
    return node_params.current_values(node, SCHEMA)


@dataclass(frozen=True)
class RuntimeConfig:
    """What may change while serving (rebuilt by the post-set callback)."""

    defaults: RequestDefaults
    feedback: FeedbackPolicy
    window_timeout_s: float = 2.0   # vision.window_timeout_s (nodes/llm_window.py)


@dataclass(frozen=True)
class LLMNodeConfig:
    """Everything on_configure needs, read once."""

    engine: EngineConfig
    process_cpus: Tuple[int, ...]   # every thread of the process ('' affinity: none)
    decode_cpus: Tuple[int, ...]    # the engine worker thread
    queue_depth: int
    board: str
    thermal: ThermalSettings
    runtime: RuntimeConfig
    warnings: Tuple[str, ...] = ()  # soft preflight findings, for the log and diagnostics
    remote: Optional[RemoteConfig] = None   # engine.backend remote: forward goals there
    detections: str = 'auto'        # detections.publish (nodes/llm_detections.py)


def runtime_config(values: Dict[str, Any]) -> RuntimeConfig:
    """Build the run-time part from parameter values (current_values or read_config's)."""
    period_ms = int(values['feedback.period_ms'])
    return RuntimeConfig(
        defaults=RequestDefaults(sampling=SamplingConfig(**schema_mod.sampling_kwargs(values)),
                                 max_tokens=int(values['max_tokens']),
                                 system_prompt=str(values['system_prompt'])),
        feedback=FeedbackPolicy(tokens=int(values['feedback.period_tokens']),
                                period_s=period_ms / 1000.0 if period_ms else 0.0),
        window_timeout_s=float(values['vision.window_timeout_s']))


def read_config(node: Node) -> LLMNodeConfig:
    """Read and check every parameter once against the schema and this machine.

    bringup's preflight checks providers, pinned cores and the CUDA kernel set here, so a
    wrong setting fails on_configure with ConfigError (naming what to fix), never later.
    """
    values = node_params.read(node, SCHEMA)
    try:
        report = preflight(values)
        engine = EngineConfig(**schema_mod.engine_kwargs(values), speculative=SpeculativeConfig(
            **schema_mod.speculative_kwargs(values)))
        plan = plan_affinity(parse_cpu_list(values['engine.cpu_affinity']),
                             engine.intra_op_threads)
        thermal = ThermalSettings.from_params(values)
    except BringupError as exc:
        raise ConfigError(str(exc)) from None
    return LLMNodeConfig(engine=engine, process_cpus=plan.process_cpus,
                         decode_cpus=plan.decode_cpus, queue_depth=int(values['queue.depth']),
                         board=str(values['board.name']),
                         thermal=thermal, runtime=runtime_config(values),
                         warnings=report.warnings, remote=remote_config(values),
                         detections=str(values['detections.publish']))


def remote_config(values: Dict[str, Any]) -> Optional[RemoteConfig]:
    """Return the remote backend's config when engine.backend is remote, else None (local)."""
    if values['engine.backend'] != 'remote':
        return None
    return RemoteConfig(**schema_mod.remote_kwargs(values))
