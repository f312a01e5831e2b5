"""A process test_memory_store.py kills with SIGKILL while it remembers.

    python test/memory_store_child.py STORE

Remembers 'note i' (with a 2 KB text, so writes take a moment) for i = 0, 1, 2, ... through
Memory.remember, forever. Prints {"writing": i} before a call and {"acked": i, "id": id} once
it returned (what ~/remember answers after).
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from memory_embed import hashed_embed  # noqa: E402, I100

from edge_llm_ros.memory.memory import Memory  # noqa: E402
from edge_llm_ros.memory.store import MemoryStore, Pose, StoreConfig  # noqa: E402

PAD = 'x' * 2048


def main(path: str) -> None:
    memory = Memory(MemoryStore(StoreConfig(path)), hashed_embed)
    i = 0
    while True:
        sys.stdout.write(json.dumps({'writing': i}) + '\n')
        sys.stdout.flush()
        row_id, _ = memory.remember(f'note {i} {PAD}', Pose('map', float(i), 0.0, 0.0),
                                    (f'n{i}',))
        sys.stdout.write(json.dumps({'acked': i, 'id': row_id}) + '\n')
        sys.stdout.flush()
        i += 1


if __name__ == '__main__':
    main(sys.argv[1])
