"""`python -m edge_llm_ros.nodes.demo "prompt"`: the whole product in one command.

Starts llm_node (embedded SmolLM2 unless --model-path) as a real process with autostart,
waits until it is active, sends the prompt through the ~/generate action with LLMClient,
streams the answer with its timings, then stops the node with SIGINT and waits for it.
Exit status: 0 when the answer came and the node stopped cleanly, 1 otherwise, 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, List, Optional

from lifecycle_msgs.msg import State
from lifecycle_msgs.srv import GetState
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from edge_llm_ros.client import LLMClient
from edge_llm_ros.nodes.ask import EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, stream_answer

STOP_TIMEOUT_S = 20.0


class NodeProcess:
    """llm_node as a child process; its output is kept (last lines) for error reports."""

    def __init__(self, name: str, params: List[str], echo: bool) -> None:
        cmd = [sys.executable, '-m', 'edge_llm_ros.nodes.llm_node', '--ros-args',
               '-r', f'__node:={name}', '-p', 'autostart:=true']
        for param in params:
            cmd += ['-p', param]
        self.name = name
        self._echo = echo
        self.lines: Deque[str] = collections.deque(maxlen=40)
        # Own process group: a Ctrl-C in the terminal reaches only us; we stop the node.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(os.environ), start_new_session=True)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if self._echo:
                print(f'[{self.name}] {line.rstrip()}', file=sys.stderr, flush=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """SIGINT, then wait; returns the exit code (kills it if it does not stop)."""
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                print(f'demo: {self.name} ignored SIGINT for {STOP_TIMEOUT_S:.0f} s: killed',
                      file=sys.stderr)
                return -9
        self._reader.join(timeout=2.0)
        return self.proc.returncode

    def tail(self) -> str:
        return '\n'.join(self.lines)


def wait_until_active(node, server: str, process: NodeProcess, timeout: float) -> Optional[str]:
    """Poll the node's lifecycle state; return None when active, else why not."""
    client = node.create_client(GetState, f'{server}/get_state')
    deadline = time.monotonic() + timeout
    label = 'not discovered'
    try:
        while time.monotonic() < deadline:
            if not process.alive():
                return f'llm_node exited with code {process.proc.returncode}'
            if client.service_is_ready():
                done = threading.Event()
                future = client.call_async(GetState.Request())
                future.add_done_callback(lambda _: done.set())
                if done.wait(5.0) and future.result() is not None:
                    state = future.result().current_state
                    label = state.label
                    if state.id == State.PRIMARY_STATE_ACTIVE:
                        return None
            time.sleep(0.2)
        return f'llm_node not active after {timeout:.0f} s (state: {label})'
    finally:
        node.destroy_client(client)


def run(args: argparse.Namespace) -> int:
    name = f'llm_node_demo_{os.getpid()}'
    server = f'/{name}'
    params = [f'model.path:={args.model_path}'] if args.model_path else []
    print(f'demo: starting {name} ({args.model_path or "embedded SmolLM2-135M"})...',
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    process = NodeProcess(name, params, echo=args.verbose)
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(f'edge_llm_demo_{os.getpid()}', start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        status = _ask(node, server, process, args, t0)
    except KeyboardInterrupt:
        status = EXIT_CANCELLED
    finally:
        code = process.stop()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
        spinner.join(timeout=2.0)
    print(f'demo: {name} stopped (exit code {code})', file=sys.stderr)
    if code != 0 and status == EXIT_OK:
        return EXIT_FAILED
    return status


def _ask(node, server: str, process: NodeProcess, args: argparse.Namespace,
         t0: float) -> int:
    problem = wait_until_active(node, server, process, args.start_timeout)
    if problem is not None:
        print(f'demo: {problem}. Last output of the node:\n{process.tail()}', file=sys.stderr)
        return EXIT_FAILED
    print(f'demo: {process.name} active after {time.monotonic() - t0:.1f} s; asking: '
          f'{args.prompt!r}\n', file=sys.stderr, flush=True)
    client = LLMClient(node, server)
    if not client.wait_for_server(timeout=10.0):
        print('demo: the action server did not appear', file=sys.stderr)
        return EXIT_FAILED
    return stream_answer(client, args)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m edge_llm_ros.nodes.demo',
                                     description=__doc__.splitlines()[0])
    parser.add_argument('prompt', nargs='?', default='What color is the sky? Answer briefly.')
    parser.add_argument('--model-path', default='',
                        help='converted model folder (default: the embedded SmolLM2)')
    parser.add_argument('--max-tokens', type=int, default=128)
    parser.add_argument('--temperature', type=float, default=None)
    parser.add_argument('--seed', type=int, default=None)
    parser.add_argument('--system', default='')
    parser.add_argument('--session', default='')
    parser.add_argument('--start-timeout', type=float, default=600.0,
                        help='seconds to wait for the node to load the model (the first run '
                             'converts the embedded model)')
    parser.add_argument('--timeout', type=float, default=300.0)
    parser.add_argument('--verbose', action='store_true', help="echo the node's log")
    return run(parser.parse_args(argv))


if __name__ == '__main__':
    sys.exit(main())
