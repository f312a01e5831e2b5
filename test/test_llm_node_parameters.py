"""llm_node's run-time parameters, with rclpy's post-set callback (Iron+) and without (Humble).

On Humble, rclpy_compat applies the accepted values from inside the validating callback,
before rclpy stores them: the node must build its runtime config from the values it is given,
not from get_parameter().
"""
import functools
import os
import subprocess
import sys

import pytest
import rclpy
from rclpy.parameter import Parameter

from edge_llm_ros import rclpy_compat
from edge_llm_ros.nodes import llm_node


@pytest.fixture(scope='module')
def ros_context():
    rclpy.init()
    yield
    rclpy.shutdown()


@pytest.fixture(params=['post-set callback', 'humble fallback'])
def node(request, ros_context, monkeypatch):
    if request.param == 'humble fallback':
        monkeypatch.setattr(llm_node, 'add_set_parameters_callbacks', functools.partial(
            rclpy_compat.add_set_parameters_callbacks, post_set_supported=False))
    elif not rclpy_compat.HAS_POST_SET_CALLBACK:
        pytest.skip('this rclpy has no post-set parameters callback (Humble)')
    created = llm_node.LLMNode(namespace=f'params_{os.getpid()}')
    yield created
    created.destroy_node()


def test_runtime_parameters_rebuild_the_runtime_config(node):
    assert node.runtime.defaults.sampling.top_k == 0
    results = node.set_parameters([Parameter('sampling.top_k', value=5),
                                   Parameter('max_tokens', value=12),
                                   Parameter('feedback.period_ms', value=40)])
    assert all(r.successful for r in results), results
    runtime = node.runtime
    assert runtime.defaults.sampling.top_k == 5 and runtime.defaults.max_tokens == 12
    assert runtime.feedback.period_s == pytest.approx(0.04)
    # Refused by the schema (top_p is in (0, 1]): neither stored nor applied.
    refused = node.set_parameters([Parameter('sampling.top_p', value=0.0)])
    assert not refused[0].successful and 'top_p' in refused[0].reason
    assert node.runtime.defaults.sampling.top_p == 1.0
    assert node.get_parameter('sampling.top_p').value == 1.0


def test_a_parameter_of_the_wrong_type_exits_2_with_one_line_saying_so():
    """nodes/runner.py's fatal-error path for llm_node: no traceback, the quoting hint."""
    proc = subprocess.run([sys.executable, '-m', 'edge_llm_ros.nodes.llm_node', '--ros-args',
                           '-r', f'__node:=llm_bad_param_{os.getpid()}',
                           '-p', 'engine.cpu_affinity:=2'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith('llm_node: error: ') and 'engine.cpu_affinity' in proc.stderr
    assert 'needs quotes' in proc.stderr and 'Traceback' not in proc.stderr
