"""A process test_session_store_engine.py kills with SIGKILL while it writes sessions.

    python test/session_store_child.py STORE MODEL_DIR

Saves sessions s0..s3 in turn, forever, through the same KVCache -> SnapshotStore -> SQLite
path as an Engine: turn i fills every KV value of its prefix with the number i and commits
the session's conversation, whose one user turn says i, with it; then it waits until the
store says the turn is written (when_written, what a goal's result waits on). Each prefix is
16 MiB, so a write takes long enough to be cut. Prints one JSON object per line:
{"writing": i} before a commit, {"committed": i} once it is on disk.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import threading  # noqa: E402, I100

import numpy as np  # noqa: E402, I100

from edge_llm_ros.runtime.conversation import Conversation  # noqa: E402
from edge_llm_ros.runtime.kv_cache import KVCache  # noqa: E402
from edge_llm_ros.runtime.types import ChatMessage  # noqa: E402
from edge_llm_ros.serving.engine import EngineConfig  # noqa: E402
from edge_llm_ros.serving.session_store import open_sessions  # noqa: E402

SESSIONS = 4
BUFFERS, HEADS, POSITIONS, HEAD_DIM = 16, 4, 1024, 64   # 16 MiB of float32 per prefix


def session_of(i: int) -> str:
    return f's{i % SESSIONS}'


def keys_of(i: int) -> list:
    return [i % SESSIONS] + list(range(100, 100 + POSITIONS - 1))


def tell(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + '\n')
    sys.stdout.flush()


def main(store: str, model_dir: str) -> None:
    config = EngineConfig(session_store=store, max_sessions=SESSIONS,
                          session_max_bytes=1 << 30)
    buffers = [np.zeros((1, HEADS, POSITIONS, HEAD_DIM), np.float32) for _ in range(BUFFERS)]
    snaps = open_sessions(config, model_dir, buffers, POSITIONS)
    cache = KVCache(buffers, POSITIONS, store=snaps)
    i = 0
    while True:
        keys = keys_of(i)
        start = cache.plan(keys, session_of(i))
        for buf in buffers:
            buf[:] = i
        cache.append(keys[start:])
        tell({'writing': i})
        cache.commit(session_of(i), Conversation(turns=(ChatMessage('user', str(i)),),
                                                 ids=tuple(keys)))
        written = threading.Event()
        snaps.when_saved(written.set)
        written.wait()
        tell({'committed': i})
        i += 1


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
