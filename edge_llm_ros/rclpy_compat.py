"""rclpy calls that differ between Humble (JetPack 6) and Jazzy, each with its fallback.

Every member of rclpy used here that Humble lacks is reached only through a hasattr check
whose Humble branch is exercised by the tests (test_rclpy_compat), so the package runs on both.
test_humble_api fails on any other use of rclpy API that Humble lacks, and on a guard here
that no test switches off (the check is a parameter defaulting to a module constant, and a
test passes False).
"""
from typing import Callable, List

from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node
from rclpy.parameter import Parameter

# Iron and later: callbacks that run after parameters were set. Humble has only the
# validating on-set callback.
HAS_POST_SET_CALLBACK = hasattr(Node, 'add_post_set_parameters_callback')


def add_set_parameters_callbacks(
        node: Node, check: Callable[[List[Parameter]], SetParametersResult],
        apply: Callable[[List[Parameter]], None],
        post_set_supported: bool = HAS_POST_SET_CALLBACK) -> None:
    """Validate parameter changes with check(), then hand the accepted ones to apply().

    apply() must read the new values from its argument (not from the node): on Humble it runs
    inside the validating callback, just before rclpy stores the values. Register no other
    validating callback after this one: on Humble apply() would already have run when that
    one rejects the change.
    """
    if post_set_supported:
        node.add_on_set_parameters_callback(check)
        node.add_post_set_parameters_callback(apply)
        return

    def check_then_apply(parameters: List[Parameter]) -> SetParametersResult:
        result = check(parameters)
        if result.successful:
            apply(parameters)
        return result

    node.add_on_set_parameters_callback(check_then_apply)
