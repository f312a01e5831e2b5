"""Regenerate the checked-in regression fixture: a small bag of greedy goals on SmolLM2.

    python -m edge_llm_ros.regression.make_fixture [--out test/data/bags/smollm2_greedy]

Starts a real llm_node (embedded SmolLM2, node default temperature 0 = greedy), sends
FIXTURE_GOALS through the Generate action while recording the transcript, feedback and
status topics, and writes the bag with this machine's CPU class (cpu_class.py) in its
custom_data. The goals leave temperature UNSET on purpose, so a node started with another
default temperature shows up as a regression on replay.
Run it with your own ROS_DOMAIN_ID; the bag is replaced only with --force.
"""
from __future__ import annotations

import argparse
from pathlib import Path
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable, List, Mapping, Optional, Sequence

from edge_llm_ros.node_process import NodeProcess
from edge_llm_ros.regression.bagio import BagWriter, LlmTopics, read_bag
from edge_llm_ros.regression.cpu_class import current_cpu_class
from edge_llm_ros.regression.errors import NodeUnavailableError, RegressionToolError

# The fixture CI replays (interface version 6, converter 9: the kquant embedded model whose
# attention takes its softmax exp from the op library, recorded on an AVX-512 machine with its
# CPU class). smollm2_greedy (version 1, no CPU class), smollm2_greedy_v2, _v4, _v5 (the
# fixture before the fused SiLU, whose own exp moved goals 1 and 2 off near ties) and _v6
# (before attention's own exp, which moved goals 0 and 2 off near ties) stay as old bags that
# must still decode and replay.
DEFAULT_OUT = Path(__file__).resolve().parents[2] / 'test' / 'data' / 'bags' / 'smollm2_greedy_v7'
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
NODE_PARAMETERS = {'autostart': True, 'sampling.temperature': 0.0, 'max_tokens': MAX_TOKENS}


def start_node(namespace: str, parameters: Mapping[str, object] = NODE_PARAMETERS
               ) -> NodeProcess:
    """Start llm_node (node name llm_node) under `namespace` as a child process."""
    return NodeProcess('llm_node', namespace=namespace, params=parameters)


def fixture_goals() -> List[dict]:
    """LLMClient.generate arguments of the fixture goals (temperature left to the node)."""
    goals = []
    for prompt, system_prompt, stop in FIXTURE_GOALS:
        goal = {'max_tokens': MAX_TOKENS, 'stop': list(stop), 'system_prompt': system_prompt}
        if system_prompt:
            goal['messages'] = [('user', prompt)]
        else:
            goal['prompt'] = prompt
        goals.append(goal)
    return goals


def record_session(node_name: str, out: Path, goals: List[dict], server_timeout_s: float,
                   goal_timeout_s: float = 120.0,
                   give_up: Optional[Callable[[], Optional[str]]] = None,
                   cpu_class: Optional[str] = None) -> None:
    """Send `goals` to `node_name` one by one and record them into the new bag `out`.

    `give_up()` may say why the node will never become active (its process exited).
    `cpu_class` is the node machine's (None: this machine's), stored in the bag.
    """
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from edge_llm_ros.client import LLMClient, LLMClientError, NodeNotActiveError
    from edge_llm_ros.regression.live import RawRecorder

    topics = LlmTopics(node_name)
    writer = BagWriter(out, cpu_class=current_cpu_class() if cpu_class is None else cpu_class)
    rclpy.init(args=None)
    node = rclpy.create_node('edge_llm_make_fixture')
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    recorder = RawRecorder(node, writer, topics.core())
    client = LLMClient(node, node_name)
    spinner.start()
    try:
        try:
            client.wait_until_active(server_timeout_s, give_up)
        except NodeNotActiveError as exc:
            raise NodeUnavailableError(str(exc)) from None
        if not client.wait_for_server(timeout=server_timeout_s):
            raise NodeUnavailableError(f'no action server at {topics.action}')
        _wait(lambda: recorder.publisher_count(topics.transcript) > 0, 10.0,
              f'{topics.transcript} has no publisher')
        for index, goal in enumerate(goals):
            outcome = client.generate(**goal).result(timeout=goal_timeout_s)
            if outcome.finish_reason not in ('stop', 'length'):
                raise RegressionToolError(
                    f'goal {index} ended {outcome.status} with {outcome.finish_reason!r}: '
                    f'{outcome.error_message}')
            print(f'make_fixture: goal {index}: {outcome.finish_reason}, '
                  f'{outcome.completion_tokens} tokens: {outcome.text!r}', flush=True)
        # The last transcript follows its result: wait for all of them.
        _wait(lambda: writer.counts.get(topics.transcript, 0) >= len(goals), 10.0, '')
    except (LLMClientError, TimeoutError) as exc:
        raise RegressionToolError(f'a fixture goal failed: {exc}') from None
    finally:
        client.destroy()
        recorder.close()
        executor.shutdown(timeout_sec=1.0)
        spinner.join(timeout=5.0)
        writer.close()
        node.destroy_node()
        rclpy.try_shutdown()
    got = writer.counts.get(topics.transcript, 0)
    if got != len(goals):
        raise RegressionToolError(f'recorded {got} transcripts for {len(goals)} goals')


def _wait(predicate: Callable[[], bool], timeout_s: float, failure: str) -> None:
    """Poll predicate (an executor thread spins meanwhile); raise `failure` unless ''."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            if failure:
                raise NodeUnavailableError(failure)
            return
        time.sleep(0.05)


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
            proc = start_node(args.namespace)
            node_name = proc.fqn
        # rosbags names the storage file after the folder: record under the final name.
        staged = tmp / out.name
        record_session(node_name, staged, fixture_goals(), args.server_timeout,
                       give_up=proc.exit_reason if proc is not None else None)
        read_bag(staged)  # what we check in must read back
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), out)
        read_bag(out)
    except RegressionToolError as exc:
        print(f'make_fixture: {exc}', file=sys.stderr)
        if proc is not None:
            print(f'last output of {proc.fqn}:\n{proc.tail()}', file=sys.stderr)
        return exc.exit_code
    finally:
        if proc is not None:
            proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f'make_fixture: wrote {out} '
          f'({sum(f.stat().st_size for f in out.iterdir()) // 1024} KiB)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
