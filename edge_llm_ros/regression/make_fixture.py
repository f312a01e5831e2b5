"""Regenerate the checked-in regression fixture: a small bag of greedy goals on SmolLM2.

    python -m edge_llm_ros.regression.make_fixture [--out test/data/bags/smollm2_greedy]

Starts a real llm_node (embedded SmolLM2, node default temperature 0 = greedy), sends
FIXTURE_GOALS through the Generate action while recording the transcript, feedback and
status topics, and writes the bag. The goals leave temperature UNSET on purpose, so a
node started with another default temperature shows up as a regression on replay.
Run it with your own ROS_DOMAIN_ID; the bag is replaced only with --force.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from edge_llm_ros.regression.bagio import BagWriter, LlmTopics, read_bag
from edge_llm_ros.regression.errors import NodeUnavailableError, RegressionToolError

DEFAULT_OUT = Path(__file__).resolve().parents[2] / 'test' / 'data' / 'bags' / 'smollm2_greedy'
MAX_TOKENS = 24
# (prompt, system prompt, stop strings). Short answers keep the bag small.
FIXTURE_GOALS = (
    ('What color is the sky on a clear day?', '', ()),
    ('Name three sensors a mobile robot uses.', 'You are a helpful robot.', ()),
    ('List the days of the week, separated by commas.', '', ('Wednesday',)),
    ('What is 2 + 2? Answer with the number only.', '', ()),
    ('What is the capital of France? Answer in one word.', '', ()),
)
# The node parameters the fixture is recorded with; replays must use the same.
NODE_PARAMETERS = ('autostart:=true', 'sampling.temperature:=0.0', f'max_tokens:={MAX_TOKENS}')


def node_command(namespace: str, parameters: Sequence[str] = NODE_PARAMETERS) -> list:
    """Command line of an llm_node under `namespace` with `parameters` (NAME:=VALUE)."""
    command = [sys.executable, '-m', 'edge_llm_ros.nodes.llm_node', '--ros-args']
    if namespace:
        command += ['-r', f'__ns:={namespace}']
    for parameter in parameters:
        command += ['-p', parameter]
    return command


def start_node(namespace: str, parameters: Sequence[str] = NODE_PARAMETERS,
               log_path: Optional[str] = None) -> subprocess.Popen:
    """Start llm_node as a child process (its output goes to `log_path` or is dropped)."""
    log = open(log_path, 'w') if log_path else subprocess.DEVNULL
    return subprocess.Popen(node_command(namespace, parameters), stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ))


def stop_node(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGINT (the node frees its model), then SIGKILL if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fixture_goals() -> list:
    """Generate.Goal messages of the fixture (temperature left to the node's default)."""
    from edge_llm_msgs.action import Generate
    from edge_llm_msgs.msg import ChatMessage

    goals = []
    for prompt, system_prompt, stop in FIXTURE_GOALS:
        goal = Generate.Goal(max_tokens=MAX_TOKENS, stop=list(stop))
        if system_prompt:
            goal.system_prompt = system_prompt
            goal.messages = [ChatMessage(role=ChatMessage.ROLE_USER, content=prompt)]
        else:
            goal.prompt = prompt
        goals.append(goal)
    return goals


def record_session(node_name: str, out: Path, goals: list, server_timeout_s: float,
                   goal_timeout_s: float = 120.0) -> None:
    """Send `goals` to `node_name` one by one and record them into the new bag `out`."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor

    from edge_llm_msgs.action import Generate
    from edge_llm_ros.regression.live import RawRecorder, wait_until_active

    topics = LlmTopics(node_name)
    writer = BagWriter(out)
    rclpy.init(args=None)
    node = rclpy.create_node('edge_llm_make_fixture')
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    recorder = RawRecorder(node, writer, topics.core())
    client = ActionClient(node, Generate, topics.action)
    try:
        if not client.wait_for_server(timeout_sec=server_timeout_s):
            raise NodeUnavailableError(
                f'no action server at {topics.action} after {server_timeout_s:g} s: did '
                'llm_node load its model? (see the node log)')
        wait_until_active(node, node_name, server_timeout_s,
                          lambda seconds: executor.spin_once(timeout_sec=seconds))
        deadline = time.monotonic() + 10.0
        while recorder.publisher_count(topics.transcript) == 0:
            executor.spin_once(timeout_sec=0.05)
            if time.monotonic() > deadline:
                raise NodeUnavailableError(f'{topics.transcript} has no publisher')
        for index, goal in enumerate(goals):
            future = client.send_goal_async(goal)
            executor.spin_until_future_complete(future, timeout_sec=server_timeout_s)
            handle = future.result()
            if handle is None or not handle.accepted:
                raise RegressionToolError(f'goal {index} was not accepted by {node_name}')
            result = handle.get_result_async()
            executor.spin_until_future_complete(result, timeout_sec=goal_timeout_s)
            if not result.done():
                raise RegressionToolError(f'goal {index} did not finish in {goal_timeout_s} s')
            answer = result.result().result
            if answer.finish_reason not in ('stop', 'length'):
                raise RegressionToolError(
                    f'goal {index} ended with {answer.finish_reason!r}: '
                    f'{answer.error_message}')
            print(f'make_fixture: goal {index}: {answer.finish_reason}, '
                  f'{answer.completion_tokens} tokens: {answer.text!r}', flush=True)
        # The last transcript follows its result: wait for all of them.
        deadline = time.monotonic() + 10.0
        while writer.counts.get(topics.transcript, 0) < len(goals) and \
                time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
    finally:
        recorder.close()
        client.destroy()
        writer.close()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    got = writer.counts.get(topics.transcript, 0)
    if got != len(goals):
        raise RegressionToolError(f'recorded {got} transcripts for {len(goals)} goals')


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m edge_llm_ros.regression.make_fixture',
        description='Record the regression fixture bag from a real llm_node (SmolLM2).')
    parser.add_argument('--out', default=str(DEFAULT_OUT), help='bag folder to write')
    parser.add_argument('--force', action='store_true', help='replace an existing bag')
    parser.add_argument('--namespace', default='', help='namespace of the started llm_node')
    parser.add_argument('--node', default='',
                        help='record from this already running node instead of starting one')
    parser.add_argument('--server-timeout', type=float, default=300.0, metavar='S',
                        help='seconds to wait for the node to load its model (default 300)')
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f'make_fixture: {out} exists: pass --force to replace it', file=sys.stderr)
        return 2
    proc = None
    tmp = Path(tempfile.mkdtemp(prefix='edge_llm_fixture_'))
    try:
        node_name = args.node
        if not node_name:
            node_name = f'{args.namespace.rstrip("/")}/llm_node' if args.namespace else \
                '/llm_node'
            proc = start_node(args.namespace, log_path=str(tmp / 'llm_node.log'))
        # rosbags names the storage file after the folder: record under the final name.
        staged = tmp / out.name
        record_session(node_name, staged, fixture_goals(), args.server_timeout)
        read_bag(staged)  # what we check in must read back
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), out)
        read_bag(out)
    except RegressionToolError as exc:
        print(f'make_fixture: {exc}', file=sys.stderr)
        log = tmp / 'llm_node.log'
        if log.exists():
            print(log.read_text()[-4000:], file=sys.stderr)
        return exc.exit_code
    finally:
        if proc is not None:
            stop_node(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f'make_fixture: wrote {out} '
          f'({sum(f.stat().st_size for f in out.iterdir()) // 1024} KiB)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
