#!/usr/bin/env python3
"""Hand-off latency and consumer CPU: zero-copy pool vs sensor_msgs/Image over rclpy.

Transports, each between two processes on this host:
  ipc         TensorPool push subscription: the fd travels once per slot, then only a
              ~60-byte descriptor; the consumer gets a read-only numpy view.
  ipc_handle  what ROS nodes do: pool publish + a TensorHandle message through rclpy /
              Fast DDS, then TensorResolver.resolve() (one socket round trip).
  ros_image   sensor_msgs/Image through rclpy / Fast DDS (default QoS, depth 10), data
              assigned once up front (best case for ROS: no per-frame fill cost).
  floor       an 8-byte stamp over a plain unix socket: the wake-up cost of any
              cross-process hand-off on this machine (no buffer at all), for scale.
  pipeline    camera -> perception -> llm stand-in over two pools (push): perception
              maps the frame, writes a 256-float "embedding" into its own pool; the
              latency is camera publish -> embedding view in the third process.
  window      the real nodes: frame_source (synthetic, image sizes only) -> perception with
              window.seconds 2 -> a client that asks ~/window for the last second (4 frames)
              at 10 Hz and builds a Generate goal from the handles. Reported: the newest
              frame's age when the goal is built (p50/p99, in the latency columns; header
              stamps, wall clock), the goal's serialized bytes against its frames' pixel bytes
              (no pixels in the goal), and how often the goal's newest frame was the newest
              published one (frame_source's ~/frames, seen by the same client).
Latency is one-way: the producer stamps CLOCK_MONOTONIC (shared by all processes)
right before publish(); the consumer stamps when it holds a usable view / message.
Consumer CPU is its user+sys time over the measured window (% of one core), with no
work of its own beyond touching the stamp.

Usage: .venv/bin/python bench/bench_ipc.py [--seconds 3] [--rates 30,60]
       [--sizes 64KB,256KB,1MB,1080p,24MB]
       [--transports floor,ipc,ipc_handle,ros_image,pipeline,window]
Prints JSON (also written to bench/results/bench_ipc.json) and a table with ratios.
"""
import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import numpy as np

from edge_llm_ros.ipc.errors import PoolClosedError, StaleHandleError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = {'64KB': (64 << 10,), '256KB': (256 << 10,), '1MB': (1 << 20,),
         '1080p': (1080, 1920, 3), '24MB': (24 << 20,), 'vga': (480, 640, 3)}
TOPIC = 'bench_ipc'


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _stamp_of(view: np.ndarray) -> int:
    return int(view.reshape(-1)[:8].view(np.int64)[0])


def _summary(lat_ns: List[int], cpu_s: float, wall_s: float, expected: int) -> Dict:
    lat = np.sort(np.asarray(lat_ns[len(lat_ns) // 10:], dtype=np.float64)) / 1e3  # warm-up
    if len(lat) == 0:
        return {'received': 0, 'expected': expected}
    return {'received': len(lat_ns), 'expected': expected,
            'p50_us': float(np.percentile(lat, 50)), 'p99_us': float(np.percentile(lat, 99)),
            'max_us': float(lat[-1]),
            'consumer_cpu_pct': 100.0 * cpu_s / wall_s if wall_s > 0 else None}


class _Window:
    """CPU and wall time between the first and the last received frame."""

    def __init__(self) -> None:
        self.t0 = self.c0 = None
        self.t1 = self.c1 = 0.0

    def tick(self) -> None:
        now, cpu = time.monotonic(), _cpu()
        if self.t0 is None:
            self.t0, self.c0 = now, cpu
        self.t1, self.c1 = now, cpu

    def cpu_wall(self) -> Tuple[float, float]:
        if self.t0 is None:
            return 0.0, 0.0
        return self.c1 - self.c0, self.t1 - self.t0


# --- consumers (child processes) -----------------------------------------------------------
def consume_ipc(args: argparse.Namespace) -> Dict:
    resolver = TensorResolver(socket_dir=args.sock_dir, name='bench')
    sub = _retry(lambda: resolver.subscribe(args.pool, max_inflight=2))
    print(json.dumps({'ready': True}), flush=True)
    lat, win = [], _Window()
    while len(lat) < args.count:
        frame = _next(sub, args.idle_s)
        if frame is None:
            break
        lat.append(time.monotonic_ns() - _stamp_of(frame.array))
        frame.release()
        win.tick()
    sub.close()
    return _summary(lat, *win.cpu_wall(), args.count)


def consume_floor(args: argparse.Namespace) -> Dict:
    import socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.path.join(args.sock_dir, 'floor.sock'))
    print(json.dumps({'ready': True}), flush=True)
    lat, win = [], _Window()
    sock.settimeout(args.idle_s)
    while len(lat) < args.count:
        try:
            data = sock.recv(64)
        except socket.timeout:
            break
        lat.append(time.monotonic_ns() - int.from_bytes(data[:8], 'little'))
        win.tick()
    return _summary(lat, *win.cpu_wall(), args.count)


def consume_pipeline_llm(args: argparse.Namespace) -> Dict:
    resolver = TensorResolver(socket_dir=args.sock_dir, name='llm')
    sub = _retry(lambda: resolver.subscribe('emb', max_inflight=2))
    print(json.dumps({'ready': True}), flush=True)
    lat, win = [], _Window()
    while len(lat) < args.count:
        frame = _next(sub, args.idle_s)
        if frame is None:
            break
        lat.append(time.monotonic_ns() - int(frame.array[:2].view(np.int64)[0]))
        frame.release()
        win.tick()
    sub.close()
    return _summary(lat, *win.cpu_wall(), args.count)


def perceive(args: argparse.Namespace) -> Dict:
    """Middle hop: map the camera frame, publish a small embedding into our own pool."""
    pool = TensorPool(PoolConfig('emb', 256 * 4, slots=4, socket_dir=args.sock_dir,
                                 allocator='auto'))
    resolver = TensorResolver(socket_dir=args.sock_dir, name='perception')
    sub = _retry(lambda: resolver.subscribe(args.pool, max_inflight=2))
    print(json.dumps({'ready': True}), flush=True)
    win, n = _Window(), 0
    while n < args.count:
        frame = _next(sub, args.idle_s)
        if frame is None:
            break
        stamp = _stamp_of(frame.array)
        loan = pool.loan()
        emb = loan.ndarray('float32', (256,))
        emb[2:] = frame.array.reshape(-1)[8:262]   # stand-in for the model's output
        emb[:2] = np.frombuffer(np.int64(stamp).tobytes(), np.float32)
        frame.release()
        loan.publish()
        n += 1
        win.tick()
    cpu, wall = win.cpu_wall()
    time.sleep(0.5)
    pool.close()
    return {'cpu_pct': 100.0 * cpu / wall if wall else None}


def _next(sub, idle_s: float):
    """Next pushed frame, or None once the stream went quiet or its producer closed."""
    try:
        return sub.receive(timeout_s=idle_s)
    except PoolClosedError:
        return None


def _ros_node(name: str):
    import rclpy
    from rclpy.node import Node
    rclpy.init()
    return rclpy, Node(name)


def consume_ros(args: argparse.Namespace) -> Dict:
    from sensor_msgs.msg import Image
    from edge_llm_msgs.msg import TensorHandle
    rclpy, node = _ros_node('bench_consumer')
    lat, win, stale = [], _Window(), []
    resolver = TensorResolver(socket_dir=args.sock_dir, name='bench') \
        if args.role == 'consume_handle' else None

    def on_image(msg) -> None:
        now = time.monotonic_ns()
        lat.append(now - (msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec))
        win.tick()

    def on_handle(msg) -> None:
        try:
            view = resolver.resolve(msg)
        except StaleHandleError:   # arrived after its slot was rewritten: a skipped frame
            stale.append(1)
            return
        now = time.monotonic_ns()
        lat.append(now - (msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec))
        del view
        resolver.release(msg)
        win.tick()

    if resolver is None:
        node.create_subscription(Image, TOPIC, on_image, 10)
    else:
        node.create_subscription(TensorHandle, TOPIC, on_handle, 10)
    print(json.dumps({'ready': True}), flush=True)
    # Discovery can take seconds on a loaded machine: wait long for the first message only.
    last, seen, patience = time.monotonic(), 0, 30.0
    while len(lat) < args.count and time.monotonic() - last < patience:
        rclpy.spin_once(node, timeout_sec=0.05)
        if len(lat) != seen:
            seen, last, patience = len(lat), time.monotonic(), args.idle_s
    node.destroy_node()
    rclpy.shutdown()
    if resolver is not None:
        resolver.close()
    return dict(_summary(lat, *win.cpu_wall(), args.count), stale=len(stale))


def _retry(fn, timeout_s: float = 30.0):
    from edge_llm_ros.ipc.errors import UnknownPoolError
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except UnknownPoolError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


# --- producer (this process) ---------------------------------------------------------------
class _Consumer:
    def __init__(self, role: str, args: argparse.Namespace, count: int, pool: str) -> None:
        cmd = [sys.executable, __file__, '--role', role, '--sock-dir', args.sock_dir,
               '--count', str(count), '--pool', pool, '--idle-s', str(args.idle_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f'{role} consumer died at start')

    def result(self) -> Dict:
        out = self.proc.stdout.read().strip()
        if self.proc.wait(60) != 0 or not out:
            raise RuntimeError(f'consumer failed (exit {self.proc.returncode}); see stderr')
        return json.loads(out.splitlines()[-1])


def _pace(start: float, i: int, rate: float) -> None:
    time.sleep(max(0.0, start + i / rate - time.monotonic()))


def _pool_for(args: argparse.Namespace, shape: Tuple[int, ...], pool_id: str) -> TensorPool:
    return TensorPool(PoolConfig(pool_id, int(np.prod(shape)), slots=6, allocator='auto',
                                 socket_dir=args.sock_dir, lease_s=5.0))


def _wait_consumers(pool: TensorPool, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(pool.stats().consumers) < n:
        if time.monotonic() > deadline:
            raise RuntimeError('consumer never subscribed')
        time.sleep(0.01)


def _write_frame(pool: TensorPool, shape: Tuple[int, ...], fill: np.ndarray):
    loan = pool.loan()
    arr = loan.ndarray('uint8', shape)
    arr.reshape(-1)[8:] = fill[8:]   # the camera writing a frame (not timed)
    return loan, arr.reshape(-1)[:8].view(np.int64)   # where the stamp goes


def run_ipc(args: argparse.Namespace, shape, rate: float, count: int) -> Dict:
    pool = _pool_for(args, shape, 'bench')
    consumer = _Consumer('consume_ipc', args, count, 'bench')
    _wait_consumers(pool, 1)
    fill = np.random.default_rng(0).integers(0, 255, int(np.prod(shape)), dtype=np.uint8)
    start = time.monotonic()
    for i in range(count):
        loan, stamp = _write_frame(pool, shape, fill)
        stamp[0] = time.monotonic_ns()
        loan.publish()
        _pace(start, i + 1, rate)
    res = consumer.result()
    res['kind'] = pool.kind.name
    pool.close()
    return res


def run_floor(args: argparse.Namespace, shape, rate: float, count: int) -> Dict:
    import socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    path = os.path.join(args.sock_dir, 'floor.sock')
    listener.bind(path)
    listener.listen(1)
    consumer = _Consumer('consume_floor', args, count, 'floor')
    conn, _ = listener.accept()
    start = time.monotonic()
    for i in range(count):
        conn.send(time.monotonic_ns().to_bytes(8, 'little'))
        _pace(start, i + 1, rate)
    res = consumer.result()
    conn.close()
    listener.close()
    os.unlink(path)
    return res


def run_pipeline(args: argparse.Namespace, shape, rate: float, count: int) -> Dict:
    pool = _pool_for(args, shape, 'cam')
    perception = _Consumer('perceive', args, count, 'cam')   # creates pool 'emb' first
    llm = _Consumer('consume_pipeline_llm', args, count, 'emb')
    _wait_consumers(pool, 1)
    fill = np.random.default_rng(0).integers(0, 255, int(np.prod(shape)), dtype=np.uint8)
    start = time.monotonic()
    for i in range(count):
        loan, stamp = _write_frame(pool, shape, fill)
        stamp[0] = time.monotonic_ns()
        loan.publish()
        _pace(start, i + 1, rate)
    res = llm.result()
    res['perception_cpu_pct'] = perception.result()['cpu_pct']
    pool.close()
    return res


def run_window(args: argparse.Namespace, shape, rate: float, count: int) -> Dict:
    """Camera -> perception (time window) -> a goal: see `window` in the module docstring."""
    if len(shape) != 3:
        return {'received': 0, 'expected': 0, 'skipped': 'window runs on image sizes only'}
    from edge_llm_msgs.action import Generate
    from edge_llm_msgs.msg import TensorHandle
    from edge_llm_msgs.srv import GetWindow
    from rclpy.serialization import serialize_message
    from edge_llm_ros.node_process import NodeProcess
    from edge_llm_ros.runtime.media import MEDIA_MARKER
    height, width = shape[:2]
    tag = f'bw{os.getpid()}'
    common = {'socket_dir': args.sock_dir}
    frames = NodeProcess('frame_source', name=f'{tag}_frames', params={
        **common, 'width': width, 'height': height, 'rate_hz': rate, 'pool.id': f'{tag}_cam'})
    perception = NodeProcess('perception', name=f'{tag}_perception', params={
        **common, 'input.topic': f'/{tag}_frames/frames', 'pool.id': f'{tag}_emb',
        'engine.intra_op_threads': 1, 'model.image_size': 32, 'window.seconds': 2.0})
    rclpy, node = _ros_node(f'{tag}_client')
    newest = [0]

    def on_frame(msg) -> None:
        newest[0] = max(newest[0], msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)

    from edge_llm_ros.nodes.tensor_output import SENSOR_QOS
    node.create_subscription(TensorHandle, f'/{tag}_frames/frames', on_frame, SENSOR_QOS)
    client = node.create_client(GetWindow, f'/{tag}_perception/window')
    ages, goal_bytes, pixel_bytes, newest_hits, asks = [], [], [], 0, max(10, count // 3)
    seen_frames = 0
    try:
        perception.wait_output('window: the last', 60)
        client.wait_for_service(timeout_sec=30)
        time.sleep(2.5)   # the window fills
        cpu0, t0 = _cpu(), time.monotonic()
        for i in range(asks):
            future = client.call_async(GetWindow.Request(last_seconds=1.0, max_frames=4))
            rclpy.spin_until_future_complete(node, future, timeout_sec=5)
            reply = future.result()
            if reply is None or not reply.success:
                continue
            goal = Generate.Goal(prompt=MEDIA_MARKER * len(reply.frames) + 'What happened?',
                                 images=reply.frames)
            data = serialize_message(goal)
            stamp = reply.frames[-1].header.stamp
            ages.append(time.time_ns() - (stamp.sec * 10**9 + stamp.nanosec))
            goal_bytes.append(len(data))
            pixel_bytes.append(sum(int(h.nbytes) for h in reply.frames))
            rclpy.spin_once(node, timeout_sec=0)   # frames seen up to now
            seen_frames += newest[0] > 0
            newest_hits += newest[0] <= stamp.sec * 10**9 + stamp.nanosec
            _pace(t0, i + 1, 10.0)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
    finally:
        node.destroy_node()
        rclpy.shutdown()
        codes = (perception.stop(), frames.stop())
    if not seen_frames:
        raise RuntimeError('the client saw no frame on ~/frames: cannot tell the newest')
    if codes != (0, 0):
        raise RuntimeError(f'window nodes exited {codes}:\n{perception.tail()}')
    res = _summary(ages, cpu, wall, asks)
    res.update(goal_bytes=int(np.median(goal_bytes)) if goal_bytes else None,
               pixel_bytes=int(np.median(pixel_bytes)) if pixel_bytes else None,
               newest_frame_pct=100.0 * newest_hits / max(len(ages), 1),
               measured='newest frame age when the goal is built (wall clock, header stamps)')
    return res


def run_ros(args: argparse.Namespace, shape, rate: float, count: int, handles: bool) -> Dict:
    from sensor_msgs.msg import Image
    from edge_llm_msgs.msg import TensorHandle
    rclpy, node = _ros_node('bench_producer')
    pub = node.create_publisher(TensorHandle if handles else Image, TOPIC, 10)
    pool = _pool_for(args, shape, 'bench') if handles else None
    consumer = _Consumer('consume_handle' if handles else 'consume_ros', args, count, 'bench')
    deadline = time.monotonic() + 30
    while pub.get_subscription_count() < 1:
        if time.monotonic() > deadline:
            raise RuntimeError('ROS consumer never matched')
        rclpy.spin_once(node, timeout_sec=0.05)
    time.sleep(0.5)   # let discovery settle both ways: the first messages are not lost
    fill = np.random.default_rng(0).integers(0, 255, int(np.prod(shape)), dtype=np.uint8)
    msg = TensorHandle() if handles else Image()
    if not handles:
        msg.height, msg.width = (shape[0], shape[1]) if len(shape) == 3 else (1, shape[0])
        msg.encoding = 'rgb8' if len(shape) == 3 else 'mono8'
        msg.step = msg.width * (3 if len(shape) == 3 else 1)
        msg.data = fill.tobytes()   # assigned once: publishing is all that is timed
    start = time.monotonic()
    for i in range(count):
        if handles:
            loan, _ = _write_frame(pool, shape, fill)
            now = time.monotonic_ns()
            loan.publish().to_msg(msg)
        else:
            now = time.monotonic_ns()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 10**9)
        pub.publish(msg)
        _pace(start, i + 1, rate)
    res = consumer.result()
    node.destroy_node()
    rclpy.shutdown()
    if pool is not None:
        pool.close()
    return res


def consumer_main(args: argparse.Namespace) -> None:
    fn = {'consume_ipc': consume_ipc, 'consume_ros': consume_ros, 'consume_floor': consume_floor,
          'consume_handle': consume_ros, 'perceive': perceive,
          'consume_pipeline_llm': consume_pipeline_llm}[args.role]
    print(json.dumps(fn(args)), flush=True)


def _fmt(v, unit='') -> str:
    if v is None:
        return '-'
    return f'{v:.0f}{unit}' if v >= 100 else f'{v:.1f}{unit}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seconds', type=float, default=3.0)
    parser.add_argument('--rates', default='30,60')
    parser.add_argument('--sizes', default=','.join(SIZES))
    parser.add_argument('--transports', default='floor,ipc,ipc_handle,ros_image,pipeline')
    parser.add_argument('--out', default=str(ROOT / 'bench' / 'results' / 'bench_ipc.json'))
    parser.add_argument('--role', help=argparse.SUPPRESS)
    parser.add_argument('--sock-dir', help=argparse.SUPPRESS)
    parser.add_argument('--count', type=int, help=argparse.SUPPRESS)
    parser.add_argument('--pool', help=argparse.SUPPRESS)
    parser.add_argument('--idle-s', type=float, default=3.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    os.environ.setdefault('ROS_DOMAIN_ID', '14')
    os.environ.setdefault('ROS_HOME', str(ROOT / '.cache' / 'ros_home'))
    if args.role:
        return consumer_main(args)

    args.sock_dir = tempfile.mkdtemp(prefix='bipc')
    results = []
    try:
        for size in args.sizes.split(','):
            shape = SIZES[size]
            for rate in (float(r) for r in args.rates.split(',')):
                count = max(20, int(rate * args.seconds))
                for transport in args.transports.split(','):
                    if transport == 'ipc':
                        res = run_ipc(args, shape, rate, count)
                    elif transport == 'floor':
                        res = run_floor(args, shape, rate, count)
                    elif transport == 'pipeline':
                        res = run_pipeline(args, shape, rate, count)
                    elif transport == 'window':
                        res = run_window(args, shape, rate, count)
                    else:
                        res = run_ros(args, shape, rate, count, transport == 'ipc_handle')
                    res.update(transport=transport, size=size,
                               nbytes=int(np.prod(shape)), rate_hz=rate)
                    results.append(res)
                    print(json.dumps(res), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(args.sock_dir, ignore_errors=True)

    report = {'host': os.uname().nodename, 'cpus': os.cpu_count(),
              'load_avg': os.getloadavg(), 'seconds_per_case': args.seconds,
              'results': results}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    by = {(r['transport'], r['size'], r['rate_hz']): r for r in results}
    print(f'\n{"size":>6} {"Hz":>3} {"transport":>10} {"p50 us":>9} {"p99 us":>9} '
          f'{"cpu %":>6} {"recv":>8} {"ros/x p50":>9}')
    for r in results:
        ros = by.get(('ros_image', r['size'], r['rate_hz']), {})
        ratio = (ros['p50_us'] / r['p50_us']) if ros.get('p50_us') and r.get('p50_us') \
            else None
        print(f'{r["size"]:>6} {r["rate_hz"]:>3.0f} {r["transport"]:>10} '
              f'{_fmt(r.get("p50_us")):>9} {_fmt(r.get("p99_us")):>9} '
              f'{_fmt(r.get("consumer_cpu_pct")):>6} '
              f'{r["received"]:>4}/{r["expected"]:<3} {_fmt(ratio, "x"):>9}')
        if r.get('goal_bytes'):
            print(f'{"":>21} goal {r["goal_bytes"]} bytes for {r["pixel_bytes"]} bytes of '
                  f'frames; newest frame in {r["newest_frame_pct"]:.0f}% of goals')


if __name__ == '__main__':
    main()
