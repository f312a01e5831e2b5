"""LLMClient.stream(): the deltas always add up to the result text, even when feedback is lost.

A real rclpy action server in this process stands in for llm_node and publishes feedback the
way llm_node does (a text delta, the token ids since the last chunk, the running count), but
can leave chunks out: one in the middle (what a late-matched feedback subscription sees at
the start of a stream), or the last one (still in flight when the result came).
"""

from rclpy.action import ActionServer
from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.action import Generate
from edge_llm_ros import client as client_module
from edge_llm_ros.client import LLMClient

WORDS = ['Robots', ' plan', ' paths', ' around', ' boxes', ' and', ' people', '.']
TEXT = ''.join(WORDS)
TIMEOUT_S = 60.0


def _serve(node, skip: set):
    """Serve TEXT one word per chunk, leaving out the chunks whose index is in `skip`."""
    def execute(goal_handle):
        for i, word in enumerate(WORDS):
            if i not in skip:
                goal_handle.publish_feedback(Generate.Feedback(
                    text_delta=word, token_ids=[100 + i], completion_tokens=i + 1))
        goal_handle.succeed()
        return Generate.Result(text=TEXT, token_ids=[100 + i for i in range(len(WORDS))],
                               completion_tokens=len(WORDS), finish_reason='stop')
    return ActionServer(node, Generate, '~/generate', execute_callback=execute,
                        callback_group=ReentrantCallbackGroup())


def _stream(ros, name: str, skip: set):
    server_node = ros(f'{name}_server')
    server = _serve(server_node, skip)
    client = LLMClient(ros(f'{name}_client'), f'/{server_node.get_name()}')
    assert client.wait_for_server(TIMEOUT_S), 'in-process action server not discovered'
    handle = client.generate('hi')
    deltas = list(handle.stream(timeout=TIMEOUT_S))
    outcome = handle.result(timeout=TIMEOUT_S)
    server.destroy()
    return deltas, outcome


def test_complete_feedback_streams_every_chunk_once(ros):
    deltas, outcome = _stream(ros, 'stream_full', skip=set())
    assert outcome.text == TEXT
    assert deltas == WORDS


def test_a_lost_middle_chunk_ends_the_stream_with_the_result_text(ros):
    deltas, outcome = _stream(ros, 'stream_gap', skip={2})
    assert ''.join(deltas) == outcome.text == TEXT
    # What came before the gap streamed as it came; the rest is one catch-up delta.
    assert len(deltas) <= 3 and deltas[-1].endswith(''.join(WORDS[2:]))


def test_a_last_chunk_that_never_comes_is_filled_in_after_the_grace(ros, monkeypatch):
    monkeypatch.setattr(client_module, 'FEEDBACK_GRACE_S', 0.5)
    deltas, outcome = _stream(ros, 'stream_tail', skip={len(WORDS) - 1})
    assert ''.join(deltas) == outcome.text == TEXT
    assert deltas[-1] == WORDS[-1]
