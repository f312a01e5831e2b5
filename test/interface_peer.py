"""Peer process for test_interfaces.py: serves edge_llm_msgs types over real DDS.

Run as a separate process so the test proves the generated types work across
processes (type support, hashes, nested messages), independently of llm_node.
The server reverses the prompt word by word and streams one word per feedback.
"""
import signal
import sys

import rclpy
from rclpy.action import ActionServer
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import TensorHandle, ToolCall, ToolCallDelta
from edge_llm_msgs.srv import Tokenize

# Feedback kept for late-matching readers: a client that just discovered this server may
# not be matched by the feedback publisher yet (each side discovers the other on its own),
# and volatile feedback published before the match would be lost. The test client uses the
# same profile. (llm_node's own, volatile, profile is edge_llm_ros.qos.FEEDBACK_QOS.)
LATCHED_FEEDBACK_QOS = QoSProfile(depth=100, history=HistoryPolicy.KEEP_LAST,
                                  reliability=ReliabilityPolicy.RELIABLE,
                                  durability=DurabilityPolicy.TRANSIENT_LOCAL)


class InterfacePeer(Node):

    def __init__(self) -> None:
        super().__init__('interface_peer')
        self._server = ActionServer(self, Generate, '~/generate', self._execute,
                                    feedback_pub_qos_profile=LATCHED_FEEDBACK_QOS)
        self._tokenize = self.create_service(Tokenize, '~/tokenize', self._on_tokenize)
        self._handles = self.create_publisher(TensorHandle, '~/handles', 10)
        self._timer = self.create_timer(0.05, self._publish_handle)
        self._sequence = 0

    def _execute(self, goal_handle):
        goal = goal_handle.request
        if goal.tools:
            return self._call_tool(goal_handle)
        words = list(reversed(goal.prompt.split()))
        for index, word in enumerate(words):
            feedback = Generate.Feedback()
            feedback.text_delta = word if index == 0 else ' ' + word
            feedback.token_ids = [index]
            feedback.completion_tokens = index + 1
            goal_handle.publish_feedback(feedback)
        goal_handle.succeed()
        result = Generate.Result()
        result.text = ' '.join(words)
        result.token_ids = list(range(len(words)))
        result.finish_reason = Generate.Result.FINISH_STOP
        result.completion_tokens = len(words)
        result.timings.total_s = 0.001
        # Echo nested goal fields back so the test can check they crossed intact.
        result.error_message = '|'.join([
            goal.messages[0].role if goal.messages else '',
            f'{goal.sampling.temperature:.2f}', str(goal.sampling.seed),
            ','.join(goal.stop), str(list(goal.prefix_embeddings[0].shape))
            if goal.prefix_embeddings else ''])
        return result

    def _call_tool(self, goal_handle):
        """Call the first tool with its schema as arguments, streamed in two deltas."""
        goal = goal_handle.request
        tool = goal.tools[0]
        half = len(tool.parameters) // 2
        for index, part in enumerate((tool.parameters[:half], tool.parameters[half:])):
            feedback = Generate.Feedback(reasoning_delta='think' if index == 0 else '',
                                         completion_tokens=index + 1, token_ids=[index])
            feedback.tool_call_deltas = [ToolCallDelta(
                index=0, id='call_0' if index == 0 else '',
                name=tool.name if index == 0 else '', arguments_delta=part)]
            goal_handle.publish_feedback(feedback)
        goal_handle.succeed()
        result = Generate.Result(finish_reason=Generate.Result.FINISH_TOOL_CALLS,
                                 reasoning='think', completion_tokens=2, token_ids=[0, 1])
        result.tool_calls = [ToolCall(id='call_0', name=tool.name, arguments=tool.parameters)]
        result.error_message = f'{goal.tool_choice}|{goal.no_parallel_tool_calls}|' \
            f'{goal.reasoning_mode}|{goal.reasoning_budget}|{goal.sampling.top_logprobs}'
        return result

    def _on_tokenize(self, request, response):
        response.success = True
        response.tokens = request.text.split()
        response.token_ids = [len(t) for t in response.tokens]
        response.context_length = 4096
        return response

    def _publish_handle(self) -> None:
        self._sequence += 1
        handle = TensorHandle()
        handle.pool_id = 'peer_pool'
        handle.sequence = self._sequence
        handle.buffer_kind = TensorHandle.KIND_MEMFD
        handle.dtype = 'uint8'
        handle.shape = [2, 3]
        handle.nbytes = 6
        self._handles.publish(handle)


def main() -> int:
    rclpy.init()
    node = InterfacePeer()
    executor = MultiThreadedExecutor()
    executor.add_node(node)
    signal.signal(signal.SIGTERM, lambda *_: rclpy.try_shutdown())
    print('READY', flush=True)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
