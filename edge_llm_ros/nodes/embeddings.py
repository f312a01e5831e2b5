"""A goal's prefix_embeddings: TensorHandles described at admission, mapped while generating.

At admission the handles are only described: each is a valid TensorDescriptor of [n, hidden]
rows, all share dtype and width, and their producer's pool is reachable. The joined shape is
declared to the engine (DeclaredEmbeddings), whose prepare() checks it against the model (hidden
size, dtype, room in the context) without allocating anything. The frames are held (mapped
read-only, no copy for a single handle) only while the job runs on the engine worker, which
binds the array into the prepared request, then released: a queued goal holds no slot of the
producer's ring, so a deep queue never starves a camera pipeline.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.types import DeclaredEmbeddings


class EmbeddingResolveError(InvalidRequestError):
    """A prefix_embeddings handle is malformed or its producer cannot serve it."""


def _rows(array_shape: Sequence[int], index: int) -> Tuple[int, int]:
    """[n, hidden] of one handle's tensor ([1, n, hidden] is accepted too)."""
    shape = tuple(int(d) for d in array_shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise EmbeddingResolveError(f'prefix_embeddings[{index}] has shape {list(array_shape)}:'
                                    f' send [n, hidden] (or [1, n, hidden]) embeddings')
    return shape[0], shape[1]


@dataclass(frozen=True)
class DescribedEmbeddings:
    """A goal's handles, parsed once: their joined declared shape and their descriptors."""

    declared: DeclaredEmbeddings
    descriptors: Tuple[Any, ...]   # ipc TensorDescriptor per handle, in order


class EmbeddingResolver:
    """Maps TensorHandles through edge_llm_ros.ipc; one per configured node."""

    def __init__(self) -> None:
        self._resolver: Any = None

    def _ipc(self) -> Any:
        if self._resolver is None:
            try:
                from edge_llm_ros.ipc.resolver import TensorResolver
            except ImportError as exc:
                raise EmbeddingResolveError(
                    f'prefix_embeddings need edge_llm_ros.ipc (cannot be imported here: {exc})'
                    f'; send the prompt without embeddings') from None
            self._resolver = TensorResolver(name='llm_node')
        return self._resolver

    def describe(self, handles: Sequence[Any]) -> Optional[DescribedEmbeddings]:
        """Check the handles without holding frames; return their shape and descriptors.

        Each handle message is parsed into its descriptor here, once; hold() takes those.
        """
        if not handles:
            return None
        resolver = self._ipc()
        from edge_llm_ros.ipc.errors import DescriptorError
        from edge_llm_ros.nodes.handles import from_handle
        rows, hidden, dtype = 0, None, None
        descriptors = []
        for index, handle in enumerate(handles):
            try:
                desc = from_handle(handle)
            except DescriptorError as exc:
                raise EmbeddingResolveError(f'prefix_embeddings[{index}] is not a valid '
                                            f'handle: {exc}') from None
            n, width = _rows(desc.shape, index)
            if hidden not in (None, width) or dtype not in (None, desc.dtype):
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}] is {desc.dtype} [{n}, {width}] but the first '
                    f'handle is {dtype} [.., {hidden}]: all must share dtype and hidden size')
            if not resolver.reachable(desc.pool_id):
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}]: no producer serves pool {desc.pool_id!r} on '
                    f'this host (is it running, with the same EDGE_LLM_IPC_DIR?)')
            rows, hidden, dtype = rows + n, width, desc.dtype
            descriptors.append(desc)
        return DescribedEmbeddings(DeclaredEmbeddings(rows=rows, hidden=hidden, dtype=dtype),
                                   tuple(descriptors))

    @contextlib.contextmanager
    def hold(self, handles: Sequence[Any]) -> Iterator[Optional[np.ndarray]]:
        """Map the frames (descriptors from describe) for a with-block (one copy if several)."""
        if not handles:
            yield None
            return
        resolver = self._ipc()
        from edge_llm_ros.ipc.errors import IpcError
        releases: List[Callable[[], None]] = []
        try:
            views = []
            for index, handle in enumerate(handles):
                try:
                    view = resolver.resolve(handle)
                except (IpcError, OSError) as exc:   # every ipc failure is the goal's error
                    raise EmbeddingResolveError(
                        f'prefix_embeddings[{index}] (pool {handle.pool_id!r}, slot '
                        f'{handle.slot}) cannot be mapped: {exc}') from None
                releases.append(lambda h=handle: resolver.release(h))
                views.append(view.reshape(-1, view.shape[-1]))   # [1, n, h] -> [n, h]
            yield views[0] if len(views) == 1 else np.concatenate(views, axis=0)
        finally:
            for release in releases:
                try:
                    release()
                except IpcError:
                    pass   # the producer is gone or revoked the lease: nothing left to give back

    def close(self) -> None:
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            resolver.close()
