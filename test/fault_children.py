"""Processes test_faults.py kills with SIGKILL mid-stream (run as scripts, never forked).

    python test/fault_children.py producer SOCK_DIR      publish frames as fast as it can
    python test/fault_children.py consumer SOCK_DIR      receive, check, release every frame

Each prints one JSON object per line on stdout (the parent reads them): the producer its
published count, connected consumers and open fds every 0.1 s; the consumer its received
and torn counts about every 20 frames, while it holds two frames at once.
"""
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_llm_ros.ipc.pool import PoolConfig, TensorPool  # noqa: E402
from edge_llm_ros.ipc.resolver import TensorResolver  # noqa: E402
from ipc_support import fill_frame, frame_ok  # noqa: E402, I100, I201

POOL = 'faults'
SHAPE = (128, 256, 3)   # 96 KiB frames: every byte depends on the sequence number


def tell(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + '\n')
    sys.stdout.flush()


def producer(sock_dir: str) -> None:
    pool = TensorPool(PoolConfig(POOL, SHAPE[0] * SHAPE[1] * SHAPE[2], slots=6,
                                 socket_dir=sock_dir, allocator='memfd', lease_s=2.0))
    tell({'ready': True})
    last = 0.0
    while True:
        loan = pool.loan()
        fill_frame(loan.ndarray('uint8', SHAPE), pool.stats().published + 1)
        loan.publish()
        now = time.monotonic()
        if now - last > 0.1:
            last = now
            stats = pool.stats()
            tell({'published': stats.published, 'consumers': len(stats.consumers),
                  'fds': len(os.listdir('/proc/self/fd'))})
        time.sleep(0.002)


def consumer(sock_dir: str) -> None:
    resolver = TensorResolver(socket_dir=sock_dir, name='doomed', max_inflight=2)
    sub = resolver.subscribe(POOL, 2)
    received = torn = 0
    held = []
    while True:
        frame = sub.receive(5.0)
        if frame is None:
            continue
        received += 1
        torn += not frame_ok(frame.array, frame.descriptor.sequence)
        held.append(frame)
        if len(held) == 2:   # hold two frames at once: SIGKILL often lands right here
            if received % 20 < 2:
                tell({'received': received, 'torn': torn, 'holding': 2})
            for f in held:
                f.release()
            held = []


if __name__ == '__main__':
    {'producer': producer, 'consumer': consumer}[sys.argv[1]](sys.argv[2])
