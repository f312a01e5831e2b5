"""A goal's tensor handles (prefix_embeddings, images): described at admission, mapped later.

At admission the handles are only described: each is a valid TensorDescriptor of the right
kind, and its producer's pool is reachable. prefix_embeddings are [n, hidden] rows that all
share dtype and width; their joined shape is declared to the engine (DeclaredEmbeddings).
images are uint8 frames, RGB [height, width, 3] (a handle carries no encoding: BGR cameras
convert first) or mono [height, width] / [height, width, 1]; each is declared by its size
(runtime.media.DeclaredImage). An image the perception node already encoded comes as its rows'
wire form (float32/float16 [grid_rows + 1, grid_cols, tile_rows, hidden],
runtime.media.DeclaredEncoded): the engine then does not run the encoder. The engine's
prepare() checks what was declared against the model (hidden size, dtype, a vision encoder,
pixel counts, room in the context) without allocating anything. The frames are held (mapped
read-only, no copy: a mono frame becomes a broadcast RGB view) only while the job runs on the
engine worker, which binds them into the prepared request, then released: a queued goal holds
no slot of the producer's ring, so a deep queue never starves a camera pipeline.

Several handles may point into one published slot (different byte_offsets): they count as one
held frame of the producer. llm_node holds at most MAX_INFLIGHT frames of one pool at a time,
so a goal whose handles name more frames of one pool than that is refused at admission; a pool
with room for more (the perception node's time window, vision/window.py) admits up to
WINDOW_INFLIGHT of them, so a goal can take several frames of a window.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.media import (as_rgb, declared_encoding, DeclaredEncoded,
                                        DeclaredImage, ENCODED_DTYPES, ImageInputError)
from edge_llm_ros.runtime.types import DeclaredEmbeddings

# Frames of one pool llm_node holds at once (its max_inflight with every producer).
MAX_INFLIGHT = 2
# Frames of one pool asked for first (granted by a pool sized for it: a perception window).
WINDOW_INFLIGHT = 8
IMAGE_FORMATS = ('uint8 RGB [height, width, 3], or mono [height, width] / [height, width, 1] '
                 '(or float32/float16 [grid_rows + 1, grid_cols, tile_rows, hidden] encoded by '
                 'the perception node)')


class EmbeddingResolveError(InvalidRequestError):
    """A prefix_embeddings handle is malformed or its producer cannot serve it."""


class ImageResolveError(ImageInputError):
    """An images handle is malformed, not an image, or its producer cannot serve it."""


def _rows(array_shape: Sequence[int], index: int) -> Tuple[int, int]:
    """[n, hidden] of one handle's tensor ([1, n, hidden] is accepted too)."""
    shape = tuple(int(d) for d in array_shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise EmbeddingResolveError(f'prefix_embeddings[{index}] has shape {list(array_shape)}:'
                                    f' send [n, hidden] (or [1, n, hidden]) embeddings')
    return shape[0], shape[1]


def _image_size(array_shape: Sequence[int], dtype: str, index: int) -> Tuple[int, int]:
    """(height, width) of one images handle's tensor; ImageResolveError names the formats."""
    shape = tuple(int(d) for d in array_shape)
    if dtype != 'uint8' or not (len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3))):
        raise ImageResolveError(f'images[{index}] is {dtype} {list(shape)}: an image handle '
                                f'must be {IMAGE_FORMATS} (convert BGR or other pixel '
                                'formats to RGB before publishing)')
    return shape[0], shape[1]


def _declared_image(shape: Sequence[int], dtype: str, index: int
                    ) -> Union[DeclaredImage, DeclaredEncoded]:
    """Return a frame's size, or an encoded image's wire form (the perception node's)."""
    if dtype in ENCODED_DTYPES and len(shape) == 4:
        encoded = DeclaredEncoded(tuple(int(d) for d in shape), dtype)
        try:
            declared_encoding(encoded, f'images[{index}]')   # the grid is checked here
        except ImageInputError as exc:
            raise ImageResolveError(str(exc)) from None
        return encoded
    return DeclaredImage(*_image_size(shape, dtype, index))


@dataclass(frozen=True)
class DescribedEmbeddings:
    """A goal's handles, parsed once: their joined declared shape and their descriptors."""

    declared: DeclaredEmbeddings
    descriptors: Tuple[Any, ...]   # ipc TensorDescriptor per handle, in order


@dataclass(frozen=True)
class DescribedImages:
    """A goal's images handles, parsed once: each image's declared size, the descriptors."""

    declared: Tuple[Union[DeclaredImage, DeclaredEncoded], ...]
    descriptors: Tuple[Any, ...]   # ipc TensorDescriptor per handle, in order


class EmbeddingResolver:
    """Maps TensorHandles (prefix_embeddings, images) through edge_llm_ros.ipc; one per node."""

    def __init__(self) -> None:
        self._resolver: Any = None

    def _ipc(self, what: str, error: type) -> Any:
        if self._resolver is None:
            try:
                from edge_llm_ros.ipc.resolver import TensorResolver
            except ImportError as exc:
                raise error(f'{what} need edge_llm_ros.ipc (cannot be imported here: {exc})'
                            f'; send the prompt without {what}') from None
            self._resolver = TensorResolver(name='llm_node', max_inflight=MAX_INFLIGHT,
                                            try_inflight=WINDOW_INFLIGHT)
        return self._resolver

    def _descriptors(self, handles: Sequence[Any], what: str, error: type) -> list:
        """Parse and check each handle (valid, pool reachable, frames per pool held at once)."""
        resolver = self._ipc(what, error)
        from edge_llm_ros.ipc.errors import DescriptorError
        from edge_llm_ros.nodes.handles import from_handle
        descriptors, frames = [], {}
        for index, handle in enumerate(handles):
            try:
                desc = from_handle(handle)
            except DescriptorError as exc:
                raise error(f'{what}[{index}] is not a valid handle: {exc}') from None
            if not resolver.reachable(desc.pool_id):
                raise error(f'{what}[{index}]: no producer serves pool {desc.pool_id!r} on '
                            f'this host (is it running, with the same EDGE_LLM_IPC_DIR?)')
            held = frames.setdefault(desc.pool_id, set())
            held.add((desc.slot, desc.generation, desc.sequence))
            most = resolver.inflight(desc.pool_id)
            if len(held) > most:
                raise error(f'{what} name {len(held)} frames of pool {desc.pool_id!r}, but '
                            f'{most} at most are held at once: put them into fewer '
                            'published slots (handles may point into one slot at different '
                            'byte_offsets), send fewer, or take them from a perception time '
                            f'window (up to {WINDOW_INFLIGHT} frames)')
            descriptors.append(desc)
        return descriptors

    def describe(self, handles: Sequence[Any]) -> Optional[DescribedEmbeddings]:
        """Check the handles without holding frames; return their shape and descriptors.

        Each handle message is parsed into its descriptor here, once; hold() takes those.
        """
        if not handles:
            return None
        descriptors = self._descriptors(handles, 'prefix_embeddings', EmbeddingResolveError)
        rows, hidden, dtype = 0, None, None
        for index, desc in enumerate(descriptors):
            n, width = _rows(desc.shape, index)
            if hidden not in (None, width) or dtype not in (None, desc.dtype):
                raise EmbeddingResolveError(
                    f'prefix_embeddings[{index}] is {desc.dtype} [{n}, {width}] but the first '
                    f'handle is {dtype} [.., {hidden}]: all must share dtype and hidden size')
            rows, hidden, dtype = rows + n, width, desc.dtype
        return DescribedEmbeddings(DeclaredEmbeddings(rows=rows, hidden=hidden, dtype=dtype),
                                   tuple(descriptors))

    def describe_images(self, handles: Sequence[Any]) -> Optional[DescribedImages]:
        """Check images handles without holding frames; return their sizes and descriptors.

        hold_images() takes the descriptors; the engine checks the sizes (prepare).
        """
        if not handles:
            return None
        descriptors = self._descriptors(handles, 'images', ImageResolveError)
        sizes = [_declared_image(d.shape, d.dtype, i) for i, d in enumerate(descriptors)]
        return DescribedImages(tuple(sizes), tuple(descriptors))

    @contextlib.contextmanager
    def _mapped(self, handles: Sequence[Any], what: str, error: type
                ) -> Iterator[List[np.ndarray]]:
        """Hold every handle's frame for a with-block: read-only views, in order."""
        resolver = self._ipc(what, error)
        from edge_llm_ros.ipc.errors import IpcError, PoolClosedError
        releases: List[Callable[[], None]] = []
        try:
            views = []
            for index, handle in enumerate(handles):
                try:
                    try:
                        views.append(resolver.resolve(handle))
                    except PoolClosedError:   # the producer restarted since: connect anew
                        views.append(resolver.resolve(handle))
                except (IpcError, OSError) as exc:   # every ipc failure is the goal's error
                    raise error(f'{what}[{index}] (pool {handle.pool_id!r}, slot '
                                f'{handle.slot}) cannot be mapped: {exc}') from None
                releases.append(lambda h=handle: resolver.release(h))
            yield views
        finally:
            for release in releases:
                try:
                    release()
                except IpcError:
                    pass   # the producer is gone or revoked the lease: nothing left to give back

    @contextlib.contextmanager
    def hold(self, handles: Sequence[Any]) -> Iterator[Optional[np.ndarray]]:
        """Map the frames (descriptors from describe) for a with-block (one copy if several)."""
        if not handles:
            yield None
            return
        with self._mapped(handles, 'prefix_embeddings', EmbeddingResolveError) as views:
            views = [view.reshape(-1, view.shape[-1]) for view in views]   # [1, n, h] -> [n, h]
            yield views[0] if len(views) == 1 else np.concatenate(views, axis=0)

    @contextlib.contextmanager
    def hold_images(self, handles: Sequence[Any], images: Optional[int] = None
                    ) -> Iterator[List[Any]]:
        """Map the image frames (descriptors from describe_images): RGB views, no copy.

        images: how many of the handles are images; the rest are one clip's frames, which
        come as one list after them (PreparedRequest.with_frames). None: all images.
        """
        with self._mapped(handles, 'images', ImageResolveError) as views:
            # An encoded image (its wire form) goes to the engine as it is.
            views = [view if view.dtype.name in ENCODED_DTYPES else as_rgb(view)
                     for view in views]
            n = len(views) if images is None else images
            yield views[:n] + ([views[n:]] if n < len(views) else [])

    def close(self) -> None:
        resolver, self._resolver = self._resolver, None
        if resolver is not None:
            resolver.close()
