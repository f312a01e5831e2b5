"""`python -m edge_llm_ros.nodes.demo "prompt"`: the whole product in one command.

Starts llm_node (embedded SmolLM2 unless --model-path) as a real process with autostart,
waits until it is active, sends the prompt through the ~/generate action with LLMClient,
streams the answer with its timings, then stops the node with SIGINT and waits for it.
Exit status: 0 when the answer came and the node stopped cleanly, 1 otherwise, 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import List, Optional

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from edge_llm_ros.client import LLMClient
from edge_llm_ros.node_process import NodeProcess, NodeStartError, NodeStopError
from edge_llm_ros.nodes.ask import EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, stream_answer

STOP_TIMEOUT_S = 20.0


def run(args: argparse.Namespace) -> int:
    name = f'llm_node_demo_{os.getpid()}'
    params = {'autostart': True}
    if args.model_path:
        params['model.path'] = args.model_path
    print(f'demo: starting {name} ({args.model_path or "embedded SmolLM2-135M"})...',
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # Own session: a Ctrl-C in the terminal reaches only us; we stop the node.
    process = NodeProcess('llm_node', name=name, params=params, own_session=True,
                          echo=sys.stderr if args.verbose else None,
                          stop_timeout=STOP_TIMEOUT_S)
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(f'edge_llm_demo_{os.getpid()}', start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    client = LLMClient(node, process.fqn)
    try:
        status = _ask(client, process, args, t0)
    except KeyboardInterrupt:
        status = EXIT_CANCELLED
    finally:
        client.destroy()
        try:
            code = process.stop()
        except NodeStopError as exc:
            print(f'demo: {exc}', file=sys.stderr)
            code = exc.returncode
        executor.shutdown(timeout_sec=1.0)
        spinner.join(timeout=2.0)
        node.destroy_node()
        rclpy.try_shutdown()
    print(f'demo: {name} stopped (exit code {code})', file=sys.stderr)
    if code != 0 and not args.verbose:
        print(f'demo: last output of {name}:\n{process.tail()}', file=sys.stderr)
    if code != 0 and status == EXIT_OK:
        return EXIT_FAILED
    return status


def _ask(client: LLMClient, process: NodeProcess, args: argparse.Namespace,
         t0: float) -> int:
    try:
        process.wait_until_active(client, args.start_timeout)
    except NodeStartError as exc:
        print(f'demo: {exc}', file=sys.stderr)
        return EXIT_FAILED
    print(f'demo: {process.name} active after {time.monotonic() - t0:.1f} s; asking: '
          f'{args.prompt!r}\n', file=sys.stderr, flush=True)
    if not client.wait_for_server(timeout=10.0):
        print('demo: the action server did not appear', file=sys.stderr)
        return EXIT_FAILED
    info = client.model_info(timeout=10.0)
    if info.success and info.loaded:  # which weights and kernels serve the answer
        print(f'demo: {info.model_name}: {info.quantization}; kernel {info.kernel or "n/a"}',
              file=sys.stderr, flush=True)
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
