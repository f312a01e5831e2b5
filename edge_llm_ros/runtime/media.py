"""Images in a request: checked once, and laid out in the prompt where its markers are.

A request brings images (RGB [H, W, 3] uint8 arrays, e.g. read-only views of mapped pool
frames, or DeclaredImage sizes whose frames are mapped when the goal starts) and marks where
each goes with llama.cpp's media marker `<__media__>` in its text: the n-th marker is the n-th
image, in a raw prompt or in any chat turn. prepare() checks the images (size, pixel format,
that the model has a vision encoder, that they fit the context) before any model work, and
lays the prompt out: the text between markers tokenized piece by piece (special tokens
parsed, as mtmd does), each marker replaced by the image's items (vision/mmproj_layout.py:
wrapper tokens and one embedding span per tile). The embeddings themselves are computed when
the goal starts (serving/engine.py), on the engine's thread.
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
from typing import List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from edge_llm_ros.errors import InvalidRequestError

MEDIA_MARKER = '<__media__>'
# More pixels than any camera a robot carries: refused before any decoding or resizing.
MAX_IMAGE_PIXELS = 40_000_000


class ImageInputError(InvalidRequestError):
    """An image the request cannot use: its format, its size, or a model without vision."""


@dataclass(frozen=True)
class DeclaredImage:
    """An image known by its size until its goal starts (a tensor handle mapped then)."""

    height: int
    width: int


ImageInput = Union[np.ndarray, DeclaredImage]


class Placement(Protocol):
    items: Tuple[Union[Tuple[int, ...], int], ...]
    rows: int
    bidirectional: bool   # the image's rows see each other both ways (one forward per span)


class ImageLayout(Protocol):
    """What a vision model says about an image of a given size (vision.PromptLayout)."""

    def place(self, height: int, width: int) -> Placement: ...


@dataclass(frozen=True)
class MediaPrompt:
    """A laid-out prompt: token ids, embedding spans (position, rows), rows per image."""

    ids: Tuple[int, ...]
    spans: Tuple[Tuple[int, int], ...]
    image_rows: Tuple[int, ...]


def image_size(image: ImageInput, name: str) -> Tuple[int, int]:
    """Return (height, width) of a usable image; ImageInputError says what is wrong."""
    if isinstance(image, DeclaredImage):
        h, w = image.height, image.width
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageInputError(
                f'{name} is {image.dtype} {list(image.shape)}: an image must be RGB '
                '[height, width, 3] uint8 (convert other pixel formats first)')
        h, w = image.shape[:2]
    else:
        raise ImageInputError(f'{name} must be an RGB uint8 array, not '
                              f'{type(image).__name__}')
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 1 or w < 1:
        raise ImageInputError(f'{name} is {w}x{h}: an image needs at least one pixel')
    if h * w > MAX_IMAGE_PIXELS:
        raise ImageInputError(f'{name} has {w}x{h} = {h * w / 1e6:.0f} megapixels, '
                              f'more than {MAX_IMAGE_PIXELS / 1e6:.0f}: scale it down first')
    return int(h), int(w)


def check_images(images: Sequence[ImageInput], layout: Optional[ImageLayout]
                 ) -> List[Placement]:
    """Check every image and return where each goes (before tokenizing anything)."""
    if isinstance(images, (str, bytes, np.ndarray)) or not isinstance(images, (list, tuple)):
        raise ImageInputError('images must be a list of images')
    if images and layout is None:
        raise ImageInputError('this model has no vision encoder: it takes no images (convert '
                              'the model with its mmproj: edge-llm-convert ... --mmproj)')
    return [layout.place(*image_size(im, f'images[{i}]')) for i, im in enumerate(images)]


def lay_out(texts: Sequence[str], placements: Sequence[Placement], encode_first, encode
            ) -> MediaPrompt:
    """Tokenize the text pieces between the markers and put each image's items between them.

    texts: the prompt split at its markers (one piece more than images); encode_first
    tokenizes the first piece (with BOS as the prompt wants it), encode the others.
    """
    ids: List[int] = []
    spans: List[Tuple[int, int]] = []
    pos = 0
    for i, text in enumerate(texts):
        piece = (encode_first if i == 0 else encode)(text) if text or i == 0 else []
        ids += piece
        pos += len(piece)
        if i == len(placements):
            break
        for item in placements[i].items:
            if isinstance(item, tuple):
                ids += item
                pos += len(item)
            else:
                spans.append((pos, item))
                pos += item
    return MediaPrompt(tuple(ids), tuple(spans), tuple(p.rows for p in placements))


def split_at_markers(text: str, n_images: int) -> List[str]:
    """Split the prompt text at its media markers; their count must be the images'."""
    texts = text.split(MEDIA_MARKER)
    if len(texts) - 1 != n_images:
        raise ImageInputError(
            f'the prompt has {len(texts) - 1} {MEDIA_MARKER} markers for {n_images} images: '
            f'put one {MEDIA_MARKER} where each image goes, in the order of images')
    return texts


def position_keys(ids: Sequence[int], spans: Sequence[Tuple[int, int]],
                  row_keys: Sequence) -> Tuple:
    """Cache key of every prompt position: token ids, and row_keys at the embedding spans."""
    keys: list = []
    t = r = 0
    for at, rows in spans:
        keys += ids[t:t + at - len(keys)]
        t = at - r
        keys += row_keys[r:r + rows]
        r += rows
    keys += ids[t:]
    return tuple(keys)


def image_digest(image: np.ndarray) -> str:
    """Content digest of an image (reads the frame in place, no copy)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(image.shape, np.int64).tobytes())
    h.update(np.ascontiguousarray(image))
    return h.hexdigest()


def rows_before(spans: Sequence[Tuple[int, int]], pos: int) -> int:
    """Embedding rows at prompt positions before `pos`."""
    return sum(min(max(pos - at, 0), rows) for at, rows in spans)


def span_starts(spans: Sequence[Tuple[int, int]], start: int, total: int) -> List[int]:
    """Positions in (start, total) where a span begins: a prefill piece must start there.

    A forward feeds its embedding rows ahead of its ids, so no piece may hold ids and then
    rows: cutting at every span's start guarantees that.
    """
    return [at for at, _ in spans if start < at < total]


def span_floor(spans: Sequence[Tuple[int, int]], pos: int) -> int:
    """`pos`, or the start of the span it falls strictly inside (a span is never split)."""
    for at, rows in spans:
        if at < pos < at + rows:
            return at
    return pos


def whole_span_cuts(spans: Sequence[Tuple[int, int]], start: int, total: int) -> List[int]:
    """Positions in (start, total) where a span begins or ends (each span is one piece)."""
    return sorted({p for at, rows in spans for p in (at, at + rows) if start < p < total})
