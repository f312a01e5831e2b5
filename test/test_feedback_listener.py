"""Feedback that arrives after its goal's result still reaches the client.

rclpy_internals.FeedbackListenersMixin is the workaround under test.

A real in-process action server answers at once; the test then publishes feedback for the
finished goal on the action's feedback topic, as a node whose last chunks trail the result
would. rclpy's own ActionClient drops it (the behaviour the workaround exists for); an
ActionClient with FeedbackListenersMixin, and so LLMClient's stream, deliver it.
"""
import threading
import time

from rclpy.action import ActionClient, ActionServer
from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.action import Generate
from edge_llm_ros import client as client_module
from edge_llm_ros.client import LLMClient
from edge_llm_ros.qos import FEEDBACK_QOS
from edge_llm_ros.rclpy_internals import FeedbackListenersMixin

WORDS = ['Late', ' chunks', ' still', ' count', '.']
TEXT = ''.join(WORDS)
TIMEOUT_S = 30.0


class KeepingClient(FeedbackListenersMixin, ActionClient):
    """rclpy's ActionClient with the workaround."""


def _server(ros, name: str):
    """Return (server node, feedback publisher) of an action server that answers at once."""
    node = ros(name)

    def execute(goal_handle):
        goal_handle.succeed()
        return Generate.Result(text=TEXT, completion_tokens=len(WORDS), finish_reason='stop')
    node.server = ActionServer(node, Generate, '~/generate', execute_callback=execute,
                               callback_group=ReentrantCallbackGroup())
    publisher = node.create_publisher(Generate.Impl.FeedbackMessage,
                                      f'/{node.get_name()}/generate/_action/feedback',
                                      FEEDBACK_QOS)
    return node, publisher


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.01)


def _done(future) -> threading.Event:
    event = threading.Event()
    future.add_done_callback(lambda _: event.set())
    return event


def _chunk(goal_id, index: int) -> Generate.Impl.FeedbackMessage:
    return Generate.Impl.FeedbackMessage(goal_id=goal_id, feedback=Generate.Feedback(
        text_delta=WORDS[index], token_ids=[100 + index], completion_tokens=index + 1))


def _late_feedback(ros, name: str, keep: bool) -> tuple:
    """Send a goal; publish one chunk before its result, one after; return what arrived.

    A plain subscription on the same topic is the control: once it has the late chunk, and
    some time passed, a client that did not deliver it has dropped it.
    """
    server_node, publisher = _server(ros, f'{name}_server')
    node = ros(f'{name}_client')
    control = []
    node.create_subscription(Generate.Impl.FeedbackMessage,
                             f'/{server_node.get_name()}/generate/_action/feedback',
                             control.append, FEEDBACK_QOS)
    client_class = KeepingClient if keep else ActionClient
    action = client_class(node, Generate, f'/{server_node.get_name()}/generate',
                          feedback_sub_qos_profile=FEEDBACK_QOS)
    assert action.wait_for_server(timeout_sec=TIMEOUT_S)
    _wait(lambda: publisher.get_subscription_count() >= 2, 'both feedback subscriptions')
    got = []
    goal_future = action.send_goal_async(Generate.Goal(prompt='hi'),
                                         feedback_callback=None if keep else got.append)
    assert _done(goal_future).wait(TIMEOUT_S)
    goal_id = goal_future.result().goal_id
    if keep:
        action.listen(bytes(goal_id.uuid), got.append)
    publisher.publish(_chunk(goal_id, 0))
    _wait(lambda: len(got) == 1, 'the chunk sent before the result')
    result_future = goal_future.result().get_result_async()
    assert _done(result_future).wait(TIMEOUT_S)
    assert result_future.result().result.text == TEXT
    publisher.publish(_chunk(goal_id, 1))
    _wait(lambda: len(control) == 2, 'the control subscription to get the late chunk')
    deadline = time.monotonic() + 1.0
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    action.destroy()
    return [m.feedback.text_delta for m in got]


def test_rclpy_action_client_drops_feedback_that_follows_the_result(ros):
    # If this fails, rclpy delivers late feedback itself: FeedbackListenersMixin can go.
    assert _late_feedback(ros, 'fb_plain', keep=False) == WORDS[:1]


def test_kept_listeners_get_feedback_that_follows_the_result(ros):
    assert _late_feedback(ros, 'fb_kept', keep=True) == WORDS[:2]


def test_llm_client_streams_chunks_that_arrive_after_the_result(ros, monkeypatch):
    monkeypatch.setattr(client_module, 'FEEDBACK_GRACE_S', TIMEOUT_S)
    server_node, publisher = _server(ros, 'fb_stream_server')
    client = LLMClient(ros('fb_stream_client'), f'/{server_node.get_name()}')
    assert client.wait_for_server(TIMEOUT_S)
    _wait(lambda: publisher.get_subscription_count() >= 1, 'the client feedback subscription')
    handle = client.generate('hi')
    outcome = handle.result(timeout=TIMEOUT_S)
    assert outcome.text == TEXT
    goal_id = handle._uuid
    for index in range(len(WORDS)):
        publisher.publish(_chunk(goal_id, index))
    # Every chunk came through the feedback path: none is the catch-up from the result text.
    assert list(handle.stream(timeout=TIMEOUT_S)) == WORDS
    client.destroy()
