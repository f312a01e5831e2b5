"""A small, deterministic stand-in for llm_node used by the regression-tool tests.

Serves edge_llm_msgs/action/Generate on ~/generate and publishes one
edge_llm_msgs/msg/Transcript per goal on ~/transcript, like llm_node (same QoS, same
refusal rules: a goal with a tensor handle of an unknown pool is accepted and aborted with
finish_reason 'error'). Its "model" is a hash of the request: greedy output depends only
on the request, so a replay is exact unless a setting changes.

    python test/fake_llm_server.py --name llm_node --namespace /a [--temperature 0.7] ...
Prints READY once serving.
"""
import argparse
import json
import random
import sys
import threading
import time
import zlib

import rclpy
from rclpy.action import ActionServer, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import SamplingParams, Transcript

WORDS = ('the sky is blue because air scatters short waves of sunlight more than long '
         'ones robots plan paths around obstacles using maps and sensors').split()
QOS = QoSProfile(depth=100, history=HistoryPolicy.KEEP_LAST,
                 reliability=ReliabilityPolicy.RELIABLE)


def request_key(goal) -> str:
    parts = [goal.prompt, goal.system_prompt, goal.json_schema]
    parts += [f'{m.role}:{m.content}' for m in goal.messages]
    return '\x00'.join(parts)


class FakeLLM(Node):

    def __init__(self, args) -> None:
        super().__init__(args.name, namespace=args.namespace)
        self.args = args
        group = ReentrantCallbackGroup()
        self.server = ActionServer(self, Generate, '~/generate', self.execute,
                                   goal_callback=self.on_goal, callback_group=group,
                                   feedback_pub_qos_profile=QOS)
        # --no-transcript: like a node built before ~/transcript existed (no publisher).
        if not args.no_transcript:
            self.transcripts = self.create_publisher(Transcript, '~/transcript', QOS)
        self.lock = threading.Lock()

    def on_goal(self, goal) -> GoalResponse:
        if self.args.reject_all:
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def effective(self, s: SamplingParams) -> SamplingParams:
        out = SamplingParams()
        out.temperature = self.args.temperature if s.temperature < 0 else s.temperature
        out.top_k = 0 if s.top_k < 0 else s.top_k
        out.top_p = 1.0 if s.top_p < 0 else s.top_p
        out.min_p = 0.0 if s.min_p < 0 else s.min_p
        out.repetition_penalty = 1.0 if s.repetition_penalty < 0 else s.repetition_penalty
        out.presence_penalty = s.presence_penalty
        out.seed = s.seed
        return out

    def generate(self, goal, sampling: SamplingParams) -> tuple:
        key = request_key(goal)
        h = zlib.crc32(key.encode())
        if goal.json_schema:
            value = WORDS[h % len(WORDS)]
            text = json.dumps({'answer': value})
            if self.args.break_json:
                text = text[:-2]
            return list(text.encode()), text, 'stop'
        if sampling.temperature == 0.0:
            rng = random.Random(h)
        else:
            rng = random.Random(sampling.seed if sampling.seed >= 0 else None)
        natural = 4 + h % 12
        limit = goal.max_tokens or self.args.max_tokens
        ids = [rng.randrange(len(WORDS)) for _ in range(min(natural, limit))]
        text = ' '.join(WORDS[i] for i in ids)
        finish = 'length' if natural > limit else 'stop'
        for stop in goal.stop:
            if stop and stop in text:
                text = text[:text.index(stop)]
                finish = 'stop'
        return ids, text, finish

    def execute(self, goal_handle):
        accepted = self.get_clock().now().to_msg()
        goal = goal_handle.request
        result = Generate.Result()
        sampling = self.effective(goal.sampling)
        unknown = [h.pool_id for h in goal.prefix_embeddings
                   if h.pool_id not in self.args.known_pool]
        start = time.monotonic()
        if unknown:
            goal_handle.abort()
            result.finish_reason = 'error'
            result.error_message = (f"tensor handle of pool '{unknown[0]}' cannot be resolved: "
                                    'no producer socket for it')
            self.publish(goal_handle, goal, None, result, accepted)
            return result
        ids, text, finish = self.generate(goal, sampling)
        time.sleep(self.args.ttft * self.args.slow)
        ttft = time.monotonic() - start
        for i, token in enumerate(ids):
            if i:
                time.sleep(self.args.token_delay * self.args.slow)
            fb = Generate.Feedback(token_ids=[token], completion_tokens=i + 1)
            goal_handle.publish_feedback(fb)
        total = time.monotonic() - start
        result.text = text
        result.token_ids = ids
        result.finish_reason = finish
        result.prompt_tokens = len(request_key(goal).split())
        result.completion_tokens = len(ids)
        result.timings.time_to_first_token_s = ttft
        result.timings.prefill_tokens = result.prompt_tokens
        result.timings.prefill_tokens_per_second = result.prompt_tokens / max(ttft, 1e-6)
        if len(ids) > 1:
            result.timings.decode_tokens_per_second = (len(ids) - 1) / max(total - ttft, 1e-6)
        result.timings.total_s = total
        goal_handle.succeed()
        self.publish(goal_handle, goal, sampling, result, accepted)
        return result

    def publish(self, goal_handle, goal, sampling, result, accepted) -> None:
        if self.args.no_transcript:
            return
        msg = Transcript(goal_id=goal_handle.goal_id, source=Transcript.SOURCE_ACTION,
                         accepted=True, accepted_stamp=accepted, model=self.args.model,
                         finished_stamp=self.get_clock().now().to_msg())
        if sampling is not None:
            msg.effective_sampling = sampling
        for name in ('prompt', 'messages', 'system_prompt', 'sampling', 'max_tokens', 'stop',
                     'json_schema', 'prefix_embeddings', 'session_id'):
            setattr(msg, name, getattr(goal, name))
        for name in ('text', 'token_ids', 'finish_reason', 'prompt_tokens',
                     'completion_tokens', 'timings', 'error_message'):
            setattr(msg, name, getattr(result, name))
        self.transcripts.publish(msg)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument('--name', default='llm_node')
    parser.add_argument('--namespace', default='/')
    parser.add_argument('--model', default='fake-llm')
    parser.add_argument('--temperature', type=float, default=0.0)
    parser.add_argument('--max-tokens', type=int, default=256)
    parser.add_argument('--ttft', type=float, default=0.004)
    parser.add_argument('--token-delay', type=float, default=0.001)
    parser.add_argument('--slow', type=float, default=1.0, help='multiplies every delay')
    parser.add_argument('--known-pool', action='append', default=[])
    parser.add_argument('--break-json', action='store_true')
    parser.add_argument('--no-transcript', action='store_true')
    parser.add_argument('--reject-all', action='store_true')
    args = parser.parse_args()
    rclpy.init()
    node = FakeLLM(args)
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(node)
    print('READY', flush=True)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
