"""Cross-process round trips of the edge_llm_msgs interfaces over real DDS."""
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from interface_peer import LATCHED_FEEDBACK_QOS
import pytest
import rclpy
from rclpy.action import ActionClient

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, SamplingParams, TensorHandle, ToolSpec
from edge_llm_msgs.srv import Tokenize

PEER = pathlib.Path(__file__).with_name('interface_peer.py')
# Generous: DDS discovery and answers of a just-started peer on a loaded CI machine.
TIMEOUT_S = 60.0


@pytest.fixture(scope='module')
def peer():
    proc = subprocess.Popen([sys.executable, str(PEER)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    assert proc.stdout.readline().strip() == 'READY'
    yield proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail('interface peer did not stop on SIGINT')


@pytest.fixture(scope='module')
def node():
    rclpy.init()
    n = rclpy.create_node('interface_test_client')
    yield n
    n.destroy_node()
    rclpy.shutdown()


def _spin_until(node, future, timeout: float) -> None:
    rclpy.spin_until_future_complete(node, future, timeout_sec=timeout)
    assert future.done(), 'no answer from the peer process within %.0f s' % timeout


def test_generate_action_round_trip(peer, node):
    client = ActionClient(node, Generate, '/interface_peer/generate',
                          feedback_sub_qos_profile=LATCHED_FEEDBACK_QOS)
    assert client.wait_for_server(timeout_sec=TIMEOUT_S), \
        'action server of the peer not discovered'
    goal = Generate.Goal()
    goal.prompt = 'one two three four'
    goal.messages = [ChatMessage(role=ChatMessage.ROLE_USER, content='hi')]
    goal.sampling = SamplingParams(temperature=0.25, seed=7)
    goal.stop = ['a', 'b']
    goal.prefix_embeddings = [TensorHandle(dtype='float32', shape=[4, 576])]
    deltas = []
    send = client.send_goal_async(goal, feedback_callback=lambda m: deltas.append(
        m.feedback.text_delta))
    _spin_until(node, send, TIMEOUT_S)
    goal_handle = send.result()
    assert goal_handle.accepted
    # Feedback travels on a topic and the result over a service: no order between them, and
    # rclpy's ActionClient drops a goal's feedback callback once its result is in. So take
    # the feedback first (the peer publishes all of it before it succeeds), then the result.
    expected = 'four three two one'
    deadline = time.monotonic() + TIMEOUT_S
    while ''.join(deltas) != expected and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    assert ''.join(deltas) == expected, 'feedback incomplete or out of order'
    result_future = goal_handle.get_result_async()
    _spin_until(node, result_future, TIMEOUT_S)
    result = result_future.result().result
    assert result.text == expected
    assert list(result.token_ids) == [0, 1, 2, 3]
    assert result.finish_reason == 'stop'
    assert result.error_message == 'user|0.25|7|a,b|[4, 576]'


def test_version_2_tool_call_round_trip(peer, node):
    """Interface version 2 fields cross processes: tools in, call deltas and calls out."""
    client = ActionClient(node, Generate, '/interface_peer/generate',
                          feedback_sub_qos_profile=LATCHED_FEEDBACK_QOS)
    assert client.wait_for_server(timeout_sec=TIMEOUT_S)
    goal = Generate.Goal(prompt='drive', tool_choice='required', no_parallel_tool_calls=True,
                         reasoning_mode=Generate.Goal.REASONING_OFF, reasoning_budget=8)
    goal.tools = [ToolSpec(name='move', description='Drive',
                           parameters='{"type": "object", "properties": {}}')]
    goal.sampling.top_logprobs = 3
    chunks = []
    send = client.send_goal_async(goal, feedback_callback=lambda m: chunks.append(m.feedback))
    _spin_until(node, send, TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while len(chunks) < 2 and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    result_future = send.result().get_result_async()
    _spin_until(node, result_future, TIMEOUT_S)
    result = result_future.result().result
    call, = result.tool_calls
    assert (call.id, call.name) == ('call_0', 'move')
    assert result.finish_reason == Generate.Result.FINISH_TOOL_CALLS == 'tool_calls'
    assert result.error_message == 'required|True|2|8|3'
    deltas = [d for c in chunks for d in c.tool_call_deltas]
    assert ''.join(d.arguments_delta for d in deltas) == call.arguments
    assert deltas[0].name == 'move' and ''.join(c.reasoning_delta for c in chunks) == 'think'


def test_tokenize_service_round_trip(peer, node):
    client = node.create_client(Tokenize, '/interface_peer/tokenize')
    assert client.wait_for_service(timeout_sec=TIMEOUT_S)
    future = client.call_async(Tokenize.Request(text='robots need words'))
    _spin_until(node, future, TIMEOUT_S)
    response = future.result()
    assert response.success
    assert list(response.tokens) == ['robots', 'need', 'words']
    assert list(response.token_ids) == [6, 4, 5]


def test_tensor_handle_topic(peer, node):
    received = []
    got = threading.Event()

    def on_handle(msg):
        received.append(msg)
        got.set()
    sub = node.create_subscription(TensorHandle, '/interface_peer/handles', on_handle, 10)
    deadline = node.get_clock().now().nanoseconds + TIMEOUT_S * 1e9
    while not got.is_set() and node.get_clock().now().nanoseconds < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    node.destroy_subscription(sub)
    assert received, 'no TensorHandle received from the peer'
    handle = received[0]
    assert handle.pool_id == 'peer_pool' and list(handle.shape) == [2, 3]
    assert handle.buffer_kind == TensorHandle.KIND_MEMFD and handle.nbytes == 6
