"""Both branches of rclpy_compat.add_set_parameters_callbacks on a real rclpy Node.

post_set_supported=True is the Iron+/Jazzy path (validate, then a post-set callback);
post_set_supported=False is the Humble path (apply from inside the validating callback),
forced here so that it runs on this Jazzy machine too (test_humble_api relies on it).
"""
import threading
from typing import List, Tuple

import pytest
from rcl_interfaces.msg import SetParametersResult
from rcl_interfaces.srv import SetParameters
from rclpy.parameter import Parameter

from edge_llm_ros import rclpy_compat
from edge_llm_ros.rclpy_compat import add_set_parameters_callbacks

TIMEOUT_S = 30.0


class Recorder:
    """check() accepts non-negative 'limit' values; apply() records what it was given."""

    def __init__(self) -> None:
        self.checked: List[List[Tuple[str, object]]] = []
        self.applied: List[List[Tuple[str, object]]] = []

    def check(self, parameters: List[Parameter]) -> SetParametersResult:
        self.checked.append([(p.name, p.value) for p in parameters])
        bad = [p.name for p in parameters if p.name == 'limit' and p.value < 0]
        return SetParametersResult(successful=not bad,
                                   reason=f'{bad} must be >= 0' if bad else '')

    def apply(self, parameters: List[Parameter]) -> None:
        self.applied.append([(p.name, p.value) for p in parameters])


def _node(ros, name: str) -> Tuple[object, Recorder]:
    node = ros(name)
    node.declare_parameter('limit', 1)
    node.declare_parameter('label', 'a')
    return node, Recorder()


def _exercise(node, recorder: Recorder) -> None:
    results = node.set_parameters([Parameter('limit', value=5)])
    assert [r.successful for r in results] == [True]
    assert recorder.checked == [[('limit', 5)]]
    assert recorder.applied == [[('limit', 5)]]
    assert node.get_parameter('limit').value == 5

    # A rejected change never reaches apply() and leaves the value alone.
    results = node.set_parameters([Parameter('limit', value=-1)])
    assert not results[0].successful and 'must be >= 0' in results[0].reason
    assert recorder.checked[-1] == [('limit', -1)]
    assert recorder.applied == [[('limit', 5)]]
    assert node.get_parameter('limit').value == 5

    # An atomic change of two parameters arrives as one list, in both callbacks.
    result = node.set_parameters_atomically(
        [Parameter('limit', value=7), Parameter('label', value='b')])
    assert result.successful
    assert recorder.applied[-1] == [('limit', 7), ('label', 'b')]
    assert recorder.checked[-1] == recorder.applied[-1]


def test_humble_branch(ros):
    node, recorder = _node(ros, 'compat_humble')
    # A literal False: test_humble_api looks for a test that switches the guard off.
    add_set_parameters_callbacks(node, recorder.check, recorder.apply, post_set_supported=False)
    _exercise(node, recorder)


@pytest.mark.skipif(not rclpy_compat.HAS_POST_SET_CALLBACK,
                    reason='this rclpy (Humble) has no post-set parameter callbacks')
def test_post_set_branch(ros):
    node, recorder = _node(ros, 'compat_post_set')
    add_set_parameters_callbacks(node, recorder.check, recorder.apply, post_set_supported=True)
    _exercise(node, recorder)


def test_humble_branch_through_the_parameter_service(ros):
    # What `ros2 param set` does: another node calls ~/set_parameters.
    node, recorder = _node(ros, 'compat_service')
    add_set_parameters_callbacks(node, recorder.check, recorder.apply, post_set_supported=False)
    caller = ros('compat_caller')
    client = caller.create_client(SetParameters,
                                  f'{node.get_fully_qualified_name()}/set_parameters')
    assert client.wait_for_service(timeout_sec=TIMEOUT_S), 'set_parameters service not found'

    def call(value: int) -> SetParametersResult:
        done = threading.Event()
        future = client.call_async(SetParameters.Request(
            parameters=[Parameter('limit', value=value).to_parameter_msg()]))
        future.add_done_callback(lambda _: done.set())
        assert done.wait(TIMEOUT_S), 'no set_parameters response'
        return future.result().results[0]

    assert call(9).successful
    assert not call(-3).successful
    assert recorder.checked == [[('limit', 9)], [('limit', -3)]]
    assert recorder.applied == [[('limit', 9)]]
    assert node.get_parameter('limit').value == 9
