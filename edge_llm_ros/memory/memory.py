"""remember / recall / forget: request checks, embedding and the store, without ROS.

    memory = Memory(MemoryStore(StoreConfig(path)), embed, MemoryConfig(max_k=50))
    row_id, evicted = memory.remember('the charger is behind the door', pose=Pose('map', 1, 2, 0))
    hits = memory.recall('where is the charger?', k=3, filters=Filters(near=..., radius_m=5))

`embed(texts, is_query)` returns (model_id, float32 [len(texts), dims]); the memory node
passes the embedding node's ~/embed. Every call checks the model against the store
(StoreModelMismatchError), so an embedding node restarted with another model is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.memory.errors import (EmptyInputError, FrameMismatchError,
                                        InvalidMemoryRequestError)
from edge_llm_ros.memory.store import Filters, Hit, MemoryStore, Pose

EmbedFn = Callable[[Sequence[str], bool], Tuple[str, np.ndarray]]


@dataclass(frozen=True)
class MemoryConfig:
    """Request limits."""

    max_k: int = 50
    max_text_bytes: int = 16384


class Memory:
    """The store plus the embedding function."""

    def __init__(self, store: MemoryStore, embed: EmbedFn,
                 config: MemoryConfig = MemoryConfig()) -> None:
        self.store = store
        self.embed_fn = embed
        self.config = config

    def _embed(self, text: str, is_query: bool) -> np.ndarray:
        model_id, vectors = self.embed_fn([text], is_query)
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != 1:
            raise InvalidMemoryRequestError(f'the embedding node returned {vectors.shape} for '
                                            'one text: check the embedding node')
        self.store.check_model(model_id, int(vectors.shape[1]))
        return vectors[0]

    def _text(self, text: str, what: str) -> str:
        if not text or not text.strip():
            raise EmptyInputError(f'{what} is empty: give the text to {what.split()[0]}')
        size = len(text.encode())
        if size > self.config.max_text_bytes:
            raise InvalidMemoryRequestError(f'{what} has {size} bytes, over memory.max_text_bytes '
                                            f'({self.config.max_text_bytes}): shorten it or '
                                            'split it into several memories')
        return text

    def remember(self, text: str, pose: Optional[Pose] = None, tags: Sequence[str] = (),
                 stamp: Optional[float] = None) -> Tuple[int, int]:
        """Embed and store one memory; (id, evicted rows). Durable when it returns."""
        self._text(text, 'remember text')
        if pose is not None and not pose.frame_id:
            raise InvalidMemoryRequestError('the pose has no frame id: set '
                                            'pose.header.frame_id (e.g. map)')
        if any(not t for t in tags):
            raise InvalidMemoryRequestError('a tag is empty: remove it')
        vector = self._embed(text, is_query=False)
        return self.store.add(text, vector, time.time() if stamp is None else stamp, tags, pose)

    def recall(self, query: str, k: int, filters: Filters = Filters()) -> List[Hit]:
        """Return the k memories nearest to the query's meaning that pass the filters."""
        self._text(query, 'recall query')
        if not 1 <= k <= self.config.max_k:
            raise InvalidMemoryRequestError(f'k = {k} is outside 1..{self.config.max_k} '
                                            '(memory.max_k): ask for fewer hits')
        if filters.since is not None and filters.until is not None and \
                filters.since > filters.until:
            raise InvalidMemoryRequestError('the time window ends before it starts: swap since '
                                            'and until')
        if filters.near is not None:
            self._check_near(filters)
        return self.store.search(self._embed(query, is_query=True), k, filters)

    def _check_near(self, filters: Filters) -> None:
        near = filters.near
        if not near.frame_id:
            raise InvalidMemoryRequestError('the pose filter has no frame id: set '
                                            'near.header.frame_id')
        if not filters.radius_m > 0 or not np.isfinite(filters.radius_m):
            raise InvalidMemoryRequestError(f'radius_m = {filters.radius_m}: give a positive '
                                            'distance in metres')
        frames = self.store.frames()
        if frames and near.frame_id not in frames:
            raise FrameMismatchError(
                f'memories are posed in {", ".join(frames)}, the query pose is in '
                f'{near.frame_id!r}, and memory does not transform poses (no tf): transform '
                f'the query pose into {frames[0]!r} first')

    def forget(self, ids: Sequence[int] = (), tags: Sequence[str] = (),
               older_than_s: float = 0.0) -> int:
        """Delete by id, by any of the tags, and by age; the number deleted."""
        if older_than_s < 0 or not np.isfinite(older_than_s):
            raise InvalidMemoryRequestError(f'older_than_s = {older_than_s}: give 0 (no age '
                                            'criterion) or a positive age in seconds')
        before = time.time() - older_than_s if older_than_s > 0 else None
        return self.store.forget(ids, tags, before)
