"""A goal's prefix_embeddings: TensorHandles checked at admission, mapped while generating.

At admission the handles are only described (TensorDescriptor validation, hidden size and
rows within the model's, producer pool reachable) and a zero placeholder of the same shape
lets the engine validate the request (context room).  The shape is checked against the model
before the placeholder is allocated: a handle's shape is the sender's word, and a zero array
of it is allocated, hashed and copied while validating.  The frames are held (mapped
read-only, no copy for a single handle) only while the job runs on the engine worker, then
released: a queued goal holds no slot of the producer's ring, so a deep queue never starves
a camera pipeline.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np

from edge_llm_ros.engine.errors import InvalidRequestError
from edge_llm_ros.engine.types import GenerationRequest


class EmbeddingResolveError(InvalidRequestError):
    """A prefix_embeddings handle is malformed or its producer cannot serve it."""


def _rows(array_shape: Sequence[int], index: int) -> Sequence[int]:
    """[n, hidden] of one handle's tensor ([1, n, hidden] is accepted too)."""
    shape = tuple(int(d) for d in array_shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise EmbeddingResolveError(f'prefix_embeddings[{index}] has shape {list(array_shape)}:'
                                    f' send [n, hidden] (or [1, n, hidden]) embeddings')
    return shape


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

    def placeholder(self, handles: Sequence[Any], hidden_size: int,
                    context_length: int) -> Optional[np.ndarray]:
        """Check the handles without holding frames; return zeros of the joined shape.

        The rows must be `hidden_size` wide and leave at least one of the model's
        `context_length` positions for the answer; the engine checks the exact room later.
        """
        if not handles:
            return None
        resolver = self._ipc()
        from edge_llm_ros.ipc.descriptor import TensorDescriptor
        rows, hidden, dtype = 0, None, None
        for index, handle in enumerate(handles):
            try:
                desc = TensorDescriptor.from_msg(handle)
            except Exception as exc:  # noqa: B902 - DescriptorError and friends
                raise EmbeddingResolveError(f'prefix_embeddings[{index}] is not a valid '
                                            f'handle: {exc}') from None
            n, width = _rows(desc.shape, index)
            if hidden not in (None, width) or dtype not in (None, desc.dtype):
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}] is {desc.dtype} [{n}, {width}] but the first '
                    f'handle is {dtype} [.., {hidden}]: all must share dtype and hidden size')
            if width != hidden_size:
                raise EmbeddingResolveError(
                    f"prefix_embeddings[{index}] rows are {width} wide but the model's hidden "
                    f'size is {hidden_size}: send [n, {hidden_size}] embeddings')
            if rows + n >= context_length:
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}] brings the embeddings to {rows + n} rows, '
                    f'which leave no room in the model context of {context_length} '
                    'positions: send fewer rows')
            if not resolver.reachable(desc.pool_id):
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}]: no producer serves pool {desc.pool_id!r} on '
                    f'this host (is it running, with the same EDGE_LLM_IPC_DIR?)')
            rows, hidden, dtype = rows + n, width, desc.dtype
        return np.zeros((rows, hidden), dtype=dtype)

    @contextlib.contextmanager
    def hold(self, handles: Sequence[Any]) -> Iterator[Optional[np.ndarray]]:
        """Map the frames for the duration of a with-block (one copy if several)."""
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
                except Exception as exc:  # noqa: B902 - every ipc failure is the goal's error
                    raise EmbeddingResolveError(
                        f'prefix_embeddings[{index}] (pool {handle.pool_id!r}, slot '
                        f'{handle.slot}) cannot be mapped: {exc}') from None
                releases.append(lambda h=handle: resolver.release(h))
                views.append(view.reshape(_rows(view.shape, index)))
            yield views[0] if len(views) == 1 else np.concatenate(views, axis=0)
        finally:
            for release in releases:
                try:
                    release()
                except IpcError:
                    pass   # the producer is gone or revoked the lease: nothing left to give back

    def binder(self, request: GenerationRequest, handles: Sequence[Any]):
        """Context-manager factory the engine worker enters around generation."""
        @contextlib.contextmanager
        def bind() -> Iterator[GenerationRequest]:
            with self.hold(handles) as array:
                yield replace(request, prefix_embeddings=array)
        return bind

    def close(self) -> None:
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            resolver.close()
