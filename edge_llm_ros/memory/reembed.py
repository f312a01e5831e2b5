"""Re-embed a memory store with another embedding model: a new store with the same rows.

    reembed(old_path, new_path, embed)   # embed(texts, is_query) -> (model_id, vectors)

Every row keeps its text, stamp, tags and pose (ids are new); the old file is not touched.
Console script (the command a model mismatch names; the memory node must be stopped):

    edge-llm-memory-reembed --store OLD.db --embed-service /embedder/embed [--out NEW.db]

Without --out the new store replaces OLD.db once complete, and OLD.db is kept as
OLD.db.<old model id>.bak.
"""
from __future__ import annotations

from typing import Callable

from edge_llm_ros.memory.memory import EmbedFn
from edge_llm_ros.memory.store import MemoryStore, StoreConfig


def reembed(old_path: str, new_path: str, embed: EmbedFn,
            progress: Callable[[int], None] = lambda n: None) -> int:
    """Copy every row of old_path into a new store at new_path, embedded by `embed`."""
    old = MemoryStore(StoreConfig(old_path, max_rows=1 << 40, max_bytes=1 << 50))
    new = MemoryStore(StoreConfig(new_path, max_rows=1 << 40, max_bytes=1 << 50))
    try:
        count = 0
        for row in old.all_rows():
            model_id, vectors = embed([row.text], False)
            new.check_model(model_id, int(vectors.shape[1]))
            new.add(row.text, vectors[0], row.stamp, row.tags, row.pose)
            count += 1
            progress(count)
        return count
    finally:
        old.close()
        new.close()
