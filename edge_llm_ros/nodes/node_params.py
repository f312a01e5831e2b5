"""Declare a node's parameters from bringup ParamSpecs and read them once, validated.

The spec gives each parameter's type, default, description, range and read_only flag (the
ParameterDescriptor), so a name is spelled and checked in exactly one place.
"""
from typing import Any, Dict, Sequence

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter

from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.parameters import ParamSpec, ParamType


class ConfigError(ValueError):
    """A parameter value is wrong; the message names the parameter and what it accepts."""


def descriptor(spec: ParamSpec) -> ParameterDescriptor:
    """ROS descriptor of one spec (ranges closed: the spec itself checks open ends)."""
    desc = ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                               additional_constraints=spec.constraints,
                               type=Parameter.Type[spec.type.name].value)
    if spec.range is not None:
        if spec.type is ParamType.INTEGER:
            desc.integer_range = [IntegerRange(from_value=int(spec.range.low),
                                               to_value=int(spec.range.high), step=0)]
        else:
            desc.floating_point_range = [FloatingPointRange(
                from_value=float(spec.range.low), to_value=float(spec.range.high), step=0.0)]
    return desc


def declare_and_read(node: Node, specs: Sequence[ParamSpec]) -> Dict[str, Any]:
    """Declare every spec on node and return the validated values by name.

    ConfigError (not a ROS exception) for a value outside its spec, so the caller can
    report it and exit cleanly.
    """
    values: Dict[str, Any] = {}
    for spec in specs:
        # An empty list default is declared by type (rclpy would infer a byte array).
        default = spec.default if spec.default != [] else Parameter.Type[spec.type.name]
        try:
            node.declare_parameter(spec.name, default, descriptor(spec))
            value = node.get_parameter(spec.name).value
        except ParameterUninitializedException:
            value = []
        except Exception as exc:  # noqa: B902 - rclpy's type/range exceptions share no base
            raise ConfigError(f'{node.get_name()}: parameter {spec.name}: {exc}') from None
        if spec.type is ParamType.STRING_ARRAY and value is not None:
            value = list(value)
        try:
            values[spec.name] = spec.validate(value, source=node.get_name())
        except BringupError as exc:
            raise ConfigError(str(exc)) from None
    return values
