"""llm_node's parameters: declared from bringup's schema, read once into a typed config.

bringup.parameters is the single source of names, types, defaults, ranges and read_only
flags; this module turns each spec into a ParameterDescriptor and reads the values into
frozen dataclasses. Load-time parameters are read_only and read in on_configure (a change
needs cleanup + configure). Request defaults (sampling, max_tokens, system_prompt) and the
feedback cadence may change at run time: values are checked against the schema (including
its open interval ends, which ROS ranges cannot express) and a post-set callback rebuilds
the frozen RuntimeConfig the hot path reads, so no code re-queries parameters per goal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                SetParametersResult)
from rclpy.exceptions import ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter

from edge_llm_ros.bringup import parameters as schema_mod
from edge_llm_ros.bringup.affinity import parse_cpu_list, plan_affinity
from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.preflight import preflight
from edge_llm_ros.bringup.thermal import ThermalSettings
from edge_llm_ros.engine.engine import EngineConfig
from edge_llm_ros.engine.types import SamplingConfig
from edge_llm_ros.nodes.messages import RequestDefaults
from edge_llm_ros.nodes.worker import FeedbackPolicy

SCHEMA = schema_mod.schema('llm_node')


class ConfigError(ValueError):
    """A parameter value is wrong or inconsistent; the message names the one to fix."""


def descriptor(spec: schema_mod.ParamSpec) -> ParameterDescriptor:
    """ROS descriptor of one schema entry (ranges closed; the schema checks openness)."""
    desc = ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                               additional_constraints=spec.constraints,
                               type=Parameter.Type[spec.type.name].value)
    if spec.range is not None:
        if spec.type is schema_mod.ParamType.INTEGER:
            desc.integer_range = [IntegerRange(from_value=int(spec.range.low),
                                               to_value=int(spec.range.high), step=0)]
        else:
            desc.floating_point_range = [FloatingPointRange(
                from_value=float(spec.range.low), to_value=float(spec.range.high), step=0.0)]
    return desc


def declare_parameters(node: Node) -> None:
    for spec in SCHEMA.specs:
        # An empty list default is declared by type (rclpy would infer a byte array).
        default = spec.default if spec.default != [] else Parameter.Type[spec.type.name]
        node.declare_parameter(spec.name, default, descriptor(spec))


def current_values(node: Node) -> Dict[str, Any]:
    values = {}
    for spec in SCHEMA.specs:
        try:
            values[spec.name] = node.get_parameter(spec.name).value
        except ParameterUninitializedException:
            values[spec.name] = []   # declared by type with an empty default, never set
    return values


def check_changes(parameters: List[Parameter]) -> SetParametersResult:
    """on_set_parameters callback: refuse values outside the schema, with its message."""
    for param in parameters:
        try:
            spec = SCHEMA.get(param.name)
            value = param.value
            if spec.type is schema_mod.ParamType.STRING_ARRAY and value is not None:
                value = list(value)
            spec.validate(value)
        except BringupError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
    return SetParametersResult(successful=True)


@dataclass(frozen=True)
class RuntimeConfig:
    """What may change while serving (rebuilt by the post-set callback)."""

    defaults: RequestDefaults
    feedback: FeedbackPolicy


@dataclass(frozen=True)
class LLMNodeConfig:
    """Everything on_configure needs, read once."""

    engine: EngineConfig
    process_cpus: Tuple[int, ...]   # every thread of the process ('' affinity: none)
    decode_cpus: Tuple[int, ...]    # the engine worker thread
    queue_depth: int
    board: str
    diagnostics_period_s: float
    thermal: ThermalSettings
    runtime: RuntimeConfig
    warnings: Tuple[str, ...] = ()  # soft preflight findings, for the log and diagnostics


def runtime_config(values: Dict[str, Any]) -> RuntimeConfig:
    period_ms = int(values['feedback.period_ms'])
    return RuntimeConfig(
        defaults=RequestDefaults(sampling=SamplingConfig(**schema_mod.sampling_kwargs(values)),
                                 max_tokens=int(values['max_tokens']),
                                 system_prompt=str(values['system_prompt'])),
        feedback=FeedbackPolicy(tokens=int(values['feedback.period_tokens']),
                                period_s=period_ms / 1000.0 if period_ms else 0.0))


def read_config(node: Node) -> LLMNodeConfig:
    """Read and check every parameter once against the schema and this machine.

    bringup's preflight checks providers, pinned cores and the CUDA kernel set here, so a
    wrong setting fails on_configure with ConfigError (naming what to fix), never later.
    """
    try:
        values = SCHEMA.validate(current_values(node), source=node.get_name())
        report = preflight(values)
        engine = EngineConfig(**schema_mod.engine_kwargs(values))
        plan = plan_affinity(parse_cpu_list(values['engine.cpu_affinity']),
                             engine.intra_op_threads)
        thermal = ThermalSettings.from_params(values)
    except BringupError as exc:
        raise ConfigError(str(exc)) from None
    return LLMNodeConfig(engine=engine, process_cpus=plan.process_cpus,
                         decode_cpus=plan.decode_cpus, queue_depth=int(values['queue.depth']),
                         board=str(values['board.name']),
                         diagnostics_period_s=float(values['diagnostics.period_s']),
                         thermal=thermal, runtime=runtime_config(values),
                         warnings=report.warnings)
