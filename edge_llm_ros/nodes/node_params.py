"""The one parameter path of every node: declare from a bringup schema, read back validated.

bringup.parameters is the single source of names, types, defaults, ranges and read_only
flags (one NodeSchema per node). Here each spec becomes a ParameterDescriptor, the values
are read back and checked against the schema (including open interval ends, which ROS
ranges cannot express), and run-time changes are checked the same way. llm_node
(nodes/llm_config.py), frame_source, perception and openai_bridge all go through these
functions, and read() refuses overrides that name no declared parameter.
"""
from typing import Any, Callable, Dict, List

from rcl_interfaces.msg import (FloatingPointRange, IntegerRange, ParameterDescriptor,
                                SetParametersResult)
from rclpy.exceptions import (InvalidParameterTypeException, InvalidParameterValueException,
                              ParameterUninitializedException)
from rclpy.node import Node
from rclpy.parameter import Parameter

from edge_llm_ros import rclpy_internals
from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.parameters import (check_overrides, NodeSchema, ParamSpec,
                                             ParamType)

# What declare_parameter raises for an override that does not fit its descriptor.
DECLARE_ERRORS = (InvalidParameterTypeException, InvalidParameterValueException)


class ConfigError(ValueError):
    """A parameter value is wrong or inconsistent; the message names the one to fix."""


def descriptor(spec: ParamSpec) -> ParameterDescriptor:
    """ROS descriptor of one spec (ranges closed: the schema itself checks open ends)."""
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


def declare(node: Node, schema: NodeSchema) -> None:
    """Declare every parameter of schema on node, with its spec's descriptor.

    An override that does not fit a descriptor raises one of DECLARE_ERRORS (rclpy's
    messages name the parameter).
    """
    for spec in schema.specs:
        # An empty list default is declared by type (rclpy would infer a byte array).
        default = spec.default if spec.default != [] else Parameter.Type[spec.type.name]
        node.declare_parameter(spec.name, default, descriptor(spec))


def current_values(node: Node, schema: NodeSchema) -> Dict[str, Any]:
    """Return the declared values by name, as they are (not validated)."""
    values = {}
    for spec in schema.specs:
        try:
            values[spec.name] = node.get_parameter(spec.name).value
        except ParameterUninitializedException:
            values[spec.name] = []   # declared by type with an empty default, never set
    return values


def read(node: Node, schema: NodeSchema) -> Dict[str, Any]:
    """Return the declared values validated against schema; ConfigError names a bad one.

    Every override the node was given must name a declared parameter (check_overrides): a
    misspelled one is a ConfigError with the closest names, never silently ignored.
    """
    try:
        passed = check_overrides(schema.node, rclpy_internals.parameter_override_names(node),
                                 node.has_parameter)
        values = schema.validate(current_values(node, schema), source=node.get_name())
    except BringupError as exc:
        raise ConfigError(str(exc)) from None
    if passed:
        node.get_logger().info(f'parameters of other edge_llm_ros nodes passed through (a '
                               f'shared params file): {", ".join(passed)}')
    return values


def declare_and_read(node: Node, schema: NodeSchema) -> Dict[str, Any]:
    """declare() then read(), every failure as ConfigError (the caller exits cleanly)."""
    try:
        declare(node, schema)
    except DECLARE_ERRORS as exc:
        raise ConfigError(f'{node.get_name()}: {exc}') from None
    return read(node, schema)


def change_checker(schema: NodeSchema) -> Callable[[List[Parameter]], SetParametersResult]:
    """Build an on-set-parameters callback that refuses values outside schema.

    Parameters rclpy declares itself (use_sim_time) are not in the schema and pass.
    """
    known = frozenset(schema.names())

    def check(parameters: List[Parameter]) -> SetParametersResult:
        for param in parameters:
            if param.name not in known:
                continue
            try:
                schema.get(param.name).validate(param.value)
            except BringupError as exc:
                return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)
    return check
