"""End-to-end latency camera -> perception -> embedding handle (-> first LLM token).

    .venv/bin/python bench/bench_vision.py [--seconds 8] [--configs 640x480@30,1920x1080@30]
                                           [--llm MODEL_DIR | --vlm VLM_DIR] [--goals 10]

Starts frame_source (synthetic pattern) and perception (stand-in model, one intra-op thread)
as processes with their sockets in a private folder. This process subscribes to both handle
topics and measures, per message, receive time - header.stamp: the stamp is taken by
frame_source just before the frame is written into its pool, and perception forwards it, so

- ``frame``: capture -> frame written into the pool -> handle received over DDS
- ``end_to_end``: capture -> perception maps it, runs the model into its own pool,
  publishes -> embeddings handle received

CPU of each node process over the window is reported too. With ``--llm`` an llm_node
serves a converted model and perception sizes its output from that model's model.yaml; for
``--goals`` fresh embedding handles (held by this process while the goal runs, so they stay
valid) a Generate goal with one completion token is sent, and ``capture -> first token``
is measured. With ``--vlm`` (a folder converted with --mmproj) perception runs that VLM's own
vision encoder on every frame (the real path, not the stand-in) and the llm_node serves the
same folder; the goals carry the rows' handle in ``images`` where the prompt says
``<__media__>``. Prints one JSON object and a table (milliseconds).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
os.environ.setdefault('ROS_HOME', str(ROOT / '.cache' / 'ros_home'))

import rclpy  # noqa: E402
from rclpy.executors import MultiThreadedExecutor  # noqa: E402

from edge_llm_msgs.msg import TensorHandle  # noqa: E402
from edge_llm_ros.client import LLMClient  # noqa: E402
from edge_llm_ros.ipc.resolver import TensorResolver  # noqa: E402
from edge_llm_ros.node_process import NodeProcess, NodeStopError  # noqa: E402
from edge_llm_ros.nodes.tensor_output import SENSOR_QOS  # noqa: E402
from edge_llm_ros.runtime.media import MEDIA_MARKER  # noqa: E402


def stats_ms(values: List[float]) -> Dict[str, float]:
    """p50/p99/mean/max of latencies given in nanoseconds, in milliseconds."""
    if not values:
        return {'n': 0}
    arr = np.asarray(values, np.float64) / 1e6
    return {'n': int(arr.size), 'p50': round(float(np.percentile(arr, 50)), 3),
            'p99': round(float(np.percentile(arr, 99)), 3),
            'mean': round(float(arr.mean()), 3), 'max': round(float(arr.max()), 3)}


class Recorder:
    """Latency of every handle received on one topic (receive time - header stamp)."""

    def __init__(self, node, topic: str) -> None:
        self._node = node
        self.latencies: List[float] = []
        self.latest: Optional[TensorHandle] = None
        self.recording = False
        self._lock = threading.Lock()
        self._new = threading.Condition(self._lock)
        node.create_subscription(TensorHandle, topic, self._on_msg, SENSOR_QOS)

    def _on_msg(self, msg: TensorHandle) -> None:
        now = self._node.get_clock().now().nanoseconds
        stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
        with self._lock:
            if self.recording:
                self.latencies.append(now - stamp)
            self.latest = msg
            self._new.notify_all()

    def wait_next(self, timeout: float) -> Optional[TensorHandle]:
        """Return the next handle received after this call (None on timeout)."""
        with self._lock:
            self.latest = None
            self._new.wait_for(lambda: self.latest is not None, timeout)
            return self.latest


def cpu_seconds(proc: NodeProcess) -> float:
    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


def run_config(node, width: int, height: int, rate: float, seconds: float, warmup: float,
               tmp: pathlib.Path, llm_dir: Optional[str], goals: int, vlm: bool = False,
               wait: float = 120.0) -> dict:
    tag = f'b{os.getpid()}_{width}x{height}'
    env = {'EDGE_LLM_IPC_DIR': str(tmp / 'sockets')}
    perception_params = {'input.topic': f'/{tag}_frames/frames', 'pool.id': f'{tag}_emb',
                         'engine.intra_op_threads': 1}
    if vlm:
        perception_params['model.path'] = llm_dir     # the VLM's own encoder
    elif llm_dir:
        perception_params['model.llm_path'] = llm_dir
    procs = {
        'frame_source': NodeProcess('frame_source', name=f'{tag}_frames', env=env, params={
            'width': width, 'height': height, 'rate_hz': rate, 'pool.id': f'{tag}_frames'}),
        'perception': NodeProcess('perception', name=f'{tag}_perception', env=env,
                                  params=perception_params),
    }
    if llm_dir:
        procs['llm_node'] = NodeProcess('llm_node', name=f'{tag}_llm', env=env, params={
            'autostart': True, 'model.path': llm_dir})
    frames = Recorder(node, f'/{tag}_frames/frames')
    embeddings = Recorder(node, f'/{tag}_perception/embeddings')
    try:
        if embeddings.wait_next(wait) is None:
            tails = '\n'.join(f'{k}:\n{p.tail()}' for k, p in procs.items())
            raise RuntimeError(f'no embeddings within {wait:g} s; last output:\n{tails}')
        time.sleep(warmup)
        cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
        frames.recording = embeddings.recording = True
        start = time.monotonic()
        time.sleep(seconds)
        frames.recording = embeddings.recording = False
        window = time.monotonic() - start
        cpu = {k: round(100 * (cpu_seconds(p) - cpu0[k]) / window, 1)
               for k, p in procs.items() if k != 'llm_node'}
        result = {
            'width': width, 'height': height, 'rate_hz': rate,
            'frames_hz': round(len(frames.latencies) / window, 2),
            'embeddings_hz': round(len(embeddings.latencies) / window, 2),
            'frame_ms': stats_ms(frames.latencies),
            'end_to_end_ms': stats_ms(embeddings.latencies),
            'cpu_percent': cpu,
        }
        if llm_dir:
            result['llm'] = measure_goals(node, embeddings, procs['llm_node'], env, goals, vlm,
                                          wait)
        return result
    finally:
        _stop_all(procs.values())


def _stop_all(procs) -> None:
    """Stop every node (SIGINT); raise afterwards if one had to be killed."""
    errors = []
    for proc in procs:
        try:
            proc.stop(timeout=15)
        except NodeStopError as exc:
            errors.append(str(exc))
    if errors:
        raise RuntimeError('\n'.join(errors))


def measure_goals(node, embeddings: Recorder, llm: NodeProcess, env: Dict[str, str],
                  goals: int, vlm: bool = False, wait: float = 30.0) -> dict:
    """Measure capture -> first token for goals carrying a fresh embeddings handle.

    vlm: the handle is a VLM image's rows, sent in `images` at a media marker.
    """
    client = LLMClient(node, llm.fqn)
    first_token, goal_ms = [], []
    try:
        llm.wait_until_active(client, timeout=600)
        if not client.wait_for_server(timeout=120):
            raise RuntimeError(f'{llm.fqn}/generate not discovered')
        with TensorResolver(socket_dir=env['EDGE_LLM_IPC_DIR'], name='bench') as resolver:
            for _ in range(goals + 1):        # the first goal warms the engine up
                handle = embeddings.wait_next(wait)
                if handle is None:
                    raise RuntimeError(f'no fresh embeddings within {wait:g} s')
                stamp = handle.header.stamp.sec * 10**9 + handle.header.stamp.nanosec
                with resolver.borrow(handle):      # held: perception cannot rewrite it meanwhile
                    first: List[int] = []

                    def on_feedback(_, first=first) -> None:
                        if not first:       # the first feedback carries the first token
                            first.append(node.get_clock().now().nanoseconds)
                    sent = node.get_clock().now().nanoseconds
                    carried = ({'images': [handle]} if vlm else
                               {'prefix_embeddings': [handle]})
                    prompt = f'{MEDIA_MARKER}What do you see?' if vlm else 'What do you see?'
                    outcome = client.generate(prompt, max_tokens=1, temperature=0.0,
                                              on_feedback=on_feedback,
                                              **carried).result(timeout=300)
                if not outcome.ok:
                    raise RuntimeError(f'goal failed: {outcome.error_message}')
                done = first[0] if first else node.get_clock().now().nanoseconds
                first_token.append(done - stamp)
                goal_ms.append(done - sent)
    finally:
        client.destroy()
    return {'capture_to_first_token_ms': stats_ms(first_token[1:]),
            'goal_to_first_token_ms': stats_ms(goal_ms[1:]),
            'prompt_tokens': outcome.prompt_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--configs', default='640x480@30,1280x720@30,1920x1080@30',
                        help='comma-separated WIDTHxHEIGHT@RATE')
    parser.add_argument('--seconds', type=float, default=8.0)
    parser.add_argument('--warmup', type=float, default=2.0)
    parser.add_argument('--llm', default='', help='converted LLM folder: also measure goals')
    parser.add_argument('--vlm', default='', help='converted VLM folder: perception runs its '
                        'encoder, goals carry the rows in images')
    parser.add_argument('--goals', type=int, default=10)
    parser.add_argument('--wait', type=float, default=120.0,
                        help='seconds to wait for an embeddings message (a real-shape VLM '
                        'encoder on a small CPU takes minutes per frame)')
    args = parser.parse_args()
    if args.llm and args.vlm:
        parser.error('give --llm or --vlm, not both')
    os.environ.setdefault('ROS_DOMAIN_ID', str(50 + os.getpid() % 40))
    rclpy.init()
    node = rclpy.create_node(f'bench_vision_{os.getpid()}')
    executor = MultiThreadedExecutor(num_threads=3)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix='bench_vision_') as tmp:
            for item in args.configs.split(','):
                size, rate = item.split('@')
                width, height = (int(v) for v in size.split('x'))
                results.append(run_config(node, width, height, float(rate), args.seconds,
                                          args.warmup, pathlib.Path(tmp),
                                          args.vlm or args.llm, args.goals, bool(args.vlm),
                                          args.wait))
    finally:
        executor.shutdown(timeout_sec=2)
        spinner.join(timeout=5)
        node.destroy_node()
        rclpy.try_shutdown()
    print(json.dumps({'bench': 'vision', 'cpus': os.cpu_count(), 'results': results},
                     indent=1))
    head = (f'{"frame":>10} {"Hz in/out":>11} {"frame p50/p99":>14} {"e2e p50/p99":>14} '
            f'{"cpu src/perc %":>15}')
    print(head)
    for r in results:
        f, e, c = r['frame_ms'], r['end_to_end_ms'], r['cpu_percent']
        print(f'{r["width"]}x{r["height"]:<5} {r["frames_hz"]:5.1f}/{r["embeddings_hz"]:<5.1f} '
              f'{f.get("p50", 0):6.2f}/{f.get("p99", 0):<7.2f} '
              f'{e.get("p50", 0):6.2f}/{e.get("p99", 0):<7.2f} '
              f'{c["frame_source"]:6.1f}/{c["perception"]:<6.1f}')
        if 'llm' in r:
            llm = r['llm']
            print(f'  capture -> first token p50 {llm["capture_to_first_token_ms"]["p50"]} ms, '
                  f'goal -> first token p50 {llm["goal_to_first_token_ms"]["p50"]} ms '
                  f'({llm["prompt_tokens"]} prompt tokens)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
