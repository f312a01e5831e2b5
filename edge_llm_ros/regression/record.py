"""edge-llm-record: record an llm_node session into a rosbag2 folder.

The transcript, the action's feedback and status topics, and optionally TensorHandle
topics and /diagnostics (docs/regression.md). metadata.yaml's custom_data keeps the CPU
class the answers were computed on (this machine's, or --cpu-class when the node runs
elsewhere), so replays know whether greedy outputs must be identical.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Optional, Sequence

from edge_llm_ros.regression.bagio import (BagWriter, DIAGNOSTICS_TOPIC, DIAGNOSTICS_TYPE,
                                           LlmTopics, STORAGES, TENSOR_HANDLE_TYPE)
from edge_llm_ros.regression.cpu_class import parse_cpu_class
from edge_llm_ros.regression.errors import RegressionToolError


def recording_topics(node: str, tensor_topics: Sequence[str] = (),
                     diagnostics: bool = False) -> dict:
    """Map topic -> type of a regression recording of `node` (docs/regression.md)."""
    topics = LlmTopics(node).core()
    for topic in tensor_topics:
        topics[topic] = TENSOR_HANDLE_TYPE
    if diagnostics:
        topics[DIAGNOSTICS_TOPIC] = DIAGNOSTICS_TYPE
    return topics


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='edge-llm-record',
        description='Record an llm_node session (transcripts = goal/result pairs, action '
                    'feedback and status) into a rosbag2 folder for edge-llm-replay. '
                    'Stops on Ctrl-C, --duration or --max-goals.')
    parser.add_argument('-o', '--output', required=True, help='new bag folder to write')
    parser.add_argument('--node', default='/llm_node',
                        help='full name of the llm_node (default /llm_node)')
    parser.add_argument('--storage', choices=STORAGES, default='mcap')
    parser.add_argument('--tensor-topic', action='append', default=[], metavar='TOPIC',
                        help='also record this edge_llm_msgs/TensorHandle topic (repeatable)')
    parser.add_argument('--diagnostics', action='store_true', help='also record /diagnostics')
    parser.add_argument('--duration', type=float, default=0.0,
                        help='stop after this many seconds (0 = until Ctrl-C)')
    parser.add_argument('--max-goals', type=int, default=0,
                        help='stop after this many transcripts (0 = no limit)')
    parser.add_argument('--cpu-class', default='', metavar='CLASS',
                        help='CPU class of the machine llm_node runs on when it is not this '
                             'one (print it there: python -m edge_llm_ros.regression.cpu_class'
                             "), or 'unknown' (default: this machine's)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        topics = recording_topics(args.node, args.tensor_topic, args.diagnostics)
        cpu_class = parse_cpu_class(args.cpu_class) if args.cpu_class else None
        writer = BagWriter(args.output, storage=args.storage, cpu_class=cpu_class)
    except (RegressionToolError, ValueError) as exc:
        print(f'edge-llm-record: {exc}', file=sys.stderr)
        return 2

    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from edge_llm_ros.regression.live import RawRecorder

    rclpy.init(args=None)
    node = rclpy.create_node('edge_llm_record')
    done = threading.Event()
    transcript_topic = LlmTopics(args.node).transcript

    def on_message(topic: str, msgtype: str, stamp: int, data: bytes) -> None:
        if topic == transcript_topic and args.max_goals and \
                writer.counts[topic] >= args.max_goals:
            done.set()

    recorder = RawRecorder(node, writer, topics, on_message=on_message)
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    print(f'edge-llm-record: recording {", ".join(topics)} into {args.output} (CPU class '
          f'{writer.cpu_class})', flush=True)
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    unmatched = set(topics)
    try:
        while not done.is_set() and (deadline is None or time.monotonic() < deadline):
            executor.spin_once(timeout_sec=0.1)
            for topic in sorted(unmatched):
                # Messages published before a topic matches are lost: say when it does.
                count = recorder.publisher_count(topic)
                if count:
                    unmatched.discard(topic)
                    print(f'edge-llm-record: matched {count} publisher(s) on {topic}',
                          flush=True)
    finally:
        recorder.close()
        writer.close()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    counts = ', '.join(f'{t}: {n}' for t, n in writer.counts.items())
    print(f'edge-llm-record: wrote {args.output} ({counts})', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
