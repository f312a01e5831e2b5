"""Images in a request: checked once, and laid out in the prompt where its markers are.

A request brings images (RGB [H, W, 3] uint8 arrays, e.g. read-only views of mapped pool
frames, or DeclaredImage sizes whose frames are mapped when the goal starts) and marks where
each goes with llama.cpp's media marker `<__media__>` in its text: the n-th marker is the n-th
image, in a raw prompt or in any chat turn. prepare() checks the images (size, pixel format,
that the model has a vision encoder, that they fit the context) before any model work, and
lays the prompt out: the text between markers tokenized piece by piece (special tokens
parsed, as mtmd does), each marker replaced by the image's items (runtime/mmproj_layout.py:
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


@dataclass(frozen=True)
class DeclaredEncoded:
    """An image already encoded (e.g. by the perception node), known by its array's shape.

    The array is the wire form of one image's embedding rows (encoded_form): float32 or
    float16 [grid_rows + 1, grid_cols, tile_rows, hidden] for a tiled image (its tiles row by
    row, then the overview or thumbnail at [grid_rows, 0]; the rest of that last row unused),
    [1, 1, tile_rows, hidden] for an image of one tile.
    """

    shape: Tuple[int, int, int, int]
    dtype: str

    @property
    def grid(self) -> Tuple[int, int, int]:
        """(columns, rows, tiles) as mmproj_preprocess.grid_for says them."""
        rows, cols = self.shape[0] - 1, self.shape[1]
        return (0, 0, 1) if rows == 0 else (cols, rows, rows * cols + 1)


@dataclass(frozen=True)
class VideoClip:
    """A clip: frames of one size, oldest first, with their times (a Qwen-VL model's video).

    frames: RGB [H, W, 3] uint8 arrays or DeclaredImage sizes (pool frames mapped when the
    goal starts); timestamps: seconds, one per frame, each later than the one before; fps:
    the rate they were sampled at (0: not said). It takes one media marker, as an image does;
    llama.cpp's mtmd merges its frames two by two (one temporal patch each, an odd last frame
    alone) and places each pair like an image (check_clip, mmproj_layout.place_clip).
    """

    frames: Tuple = ()
    timestamps: Tuple[float, ...] = ()
    fps: float = 0.0


ImageInput = Union[np.ndarray, DeclaredImage, DeclaredEncoded, VideoClip]
ENCODED_DTYPES = ('float32', 'float16')


class Placement(Protocol):
    items: Tuple[Union[Tuple[int, ...], int], ...]
    rows: int
    bidirectional: bool   # the image's rows see each other both ways (one forward per span)


class ImageLayout(Protocol):
    """What a vision model says about an image of a given size (vision.PromptLayout)."""

    def place(self, height: int, width: int) -> Placement: ...

    def place_encoded(self, encoded: DeclaredEncoded, name: str) -> Placement: ...

    def place_clip(self, height: int, width: int, frames: int, name: str) -> Placement: ...

    def check_clips(self, name: str) -> None: ...


@dataclass(frozen=True)
class MediaPrompt:
    """A laid-out prompt: token ids, embedding spans (position, rows), rows per image.

    image_at: where each image's items start, as an index into `ids` (a stored conversation
    keeps it to find its text between the images again).
    """

    ids: Tuple[int, ...]
    spans: Tuple[Tuple[int, int], ...]
    image_rows: Tuple[int, ...]
    image_at: Tuple[int, ...] = ()


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


def declared_encoding(image: ImageInput, name: str) -> Optional[DeclaredEncoded]:
    """Return the DeclaredEncoded of an already encoded image (declared or array), else None."""
    if isinstance(image, DeclaredEncoded):
        encoded = image
    elif isinstance(image, np.ndarray) and image.dtype.name in ENCODED_DTYPES and \
            image.ndim == 4:   # other float arrays are no images (image_size says so)
        encoded = DeclaredEncoded(tuple(int(d) for d in image.shape), image.dtype.name)
    else:
        return None
    shape = encoded.shape
    # A tiled image has grid_rows + 1 >= 2 rows of any number of columns (one for a tall
    # image); a single tile is [1, 1, ...].
    if len(shape) != 4 or min(shape) < 1 or (shape[0] == 1 and shape[1] != 1):
        raise ImageInputError(
            f'{name} is an encoded image of shape {list(shape)}: send [grid_rows + 1, '
            'grid_cols, tile_rows, hidden] (a tiled image) or [1, 1, tile_rows, hidden] (one '
            'tile), as the perception node publishes it')
    return encoded


def as_rgb(view: np.ndarray) -> np.ndarray:
    """RGB [h, w, 3] of a mapped image frame, without copying (mono: a broadcast view)."""
    if view.ndim == 3 and view.shape[2] == 3:
        return view
    mono = view if view.ndim == 3 else view[:, :, None]
    return np.broadcast_to(mono, mono.shape[:2] + (3,))


def check_video(layout: Optional[ImageLayout], name: str) -> None:
    """Raise ImageInputError naming `name` unless the model takes video clips (no frames read)."""
    if layout is None:
        raise ImageInputError(f'{name} is a video clip, but this model has no vision encoder '
                              '(convert a Qwen2.5-VL or Qwen3-VL model with its mmproj: '
                              'edge-llm-convert ... --mmproj)')
    layout.check_clips(name)


def check_images(images: Sequence[ImageInput], layout: Optional[ImageLayout]
                 ) -> List[Placement]:
    """Check every image and return where each goes (before tokenizing anything)."""
    if isinstance(images, (str, bytes, np.ndarray)) or not isinstance(images, (list, tuple)):
        raise ImageInputError('images must be a list of images')
    if images and layout is None:
        raise ImageInputError('this model has no vision encoder: it takes no images (convert '
                              'the model with its mmproj: edge-llm-convert ... --mmproj)')
    placements = []
    for i, image in enumerate(images):
        name = f'images[{i}]'
        if isinstance(image, VideoClip):
            placements.append(layout.place_clip(*check_clip(image, name), name))
            continue
        encoded = declared_encoding(image, name)
        placements.append(layout.place_encoded(encoded, name) if encoded is not None else
                          layout.place(*image_size(image, name)))
    return placements


def check_clip(clip: VideoClip, name: str) -> Tuple[int, int, int]:
    """Return a clip's (height, width, frames); ImageInputError says what is wrong.

    Its frames must be images of one size and its timestamps one per frame, finite and each
    later than the one before (they are checked before any pixel is read).
    """
    frames = clip.frames
    if isinstance(frames, (str, bytes, np.ndarray)) or not isinstance(frames, (list, tuple)) \
            or not frames:
        raise ImageInputError(f'{name} is a clip without frames: give its frames as a list')
    sizes = [image_size(f, f'{name}.frames[{j}]') for j, f in enumerate(frames)]
    for j, size in enumerate(sizes):
        if size != sizes[0]:
            raise ImageInputError(
                f'{name}.frames[{j}] is {size[1]}x{size[0]}, but frames[0] is '
                f'{sizes[0][1]}x{sizes[0][0]}: every frame of a clip must have one size '
                '(resize them to one size first)')
    stamps = tuple(clip.timestamps)
    if len(stamps) != len(frames):
        raise ImageInputError(f'{name} has {len(stamps)} timestamps for {len(frames)} frames: '
                              'give one timestamp (seconds) per frame')
    try:
        times = np.asarray(stamps, np.float64)
    except (TypeError, ValueError):
        raise ImageInputError(f'{name} timestamps must be numbers (seconds)') from None
    if not np.isfinite(times).all():
        raise ImageInputError(f'{name} has a NaN or infinite timestamp')
    later = np.diff(times) > 0
    if not later.all():
        j = int(np.argmin(later)) + 1
        raise ImageInputError(
            f'{name} timestamps are out of order: frames[{j}] at {times[j]:g} s is not after '
            f'frames[{j - 1}] at {times[j - 1]:g} s: send the frames oldest first')
    fps = clip.fps
    if isinstance(fps, bool) or not isinstance(fps, (int, float, np.floating, np.integer)) or \
            not np.isfinite(fps) or fps < 0:
        raise ImageInputError(f'{name} fps must be a finite number >= 0 (0: not said), got '
                              f'{fps!r}')
    return sizes[0][0], sizes[0][1], len(frames)


def clip_pairs(frames: Sequence) -> List[Tuple]:
    """Return a clip's temporal chunks as mtmd groups them: frames 2 by 2, an odd last alone."""
    return [tuple(frames[j:j + 2]) for j in range(0, len(frames), 2)]


def clip_digest(digests: Sequence[str]) -> str:
    """Content digest of a clip or chunk from its frames' digests."""
    return hashlib.blake2b(('clip:' + ','.join(digests)).encode(), digest_size=16).hexdigest()


def encoded_form(rows: np.ndarray, grid: Tuple[int, int, int], tile_rows: int,
                 out: Optional[np.ndarray] = None) -> np.ndarray:
    """Write one image's embedding rows [tiles * tile_rows, hidden] in its wire form.

    grid: (columns, rows, tiles) of the image (grid_for); out: an array of that shape to
    write into (a pool slot), else a new one. See DeclaredEncoded.
    """
    cols, grid_rows, tiles = grid
    hidden = rows.shape[-1]
    shape = (grid_rows + 1, max(cols, 1), tile_rows, hidden)
    if rows.shape != (tiles * tile_rows, hidden):
        raise ValueError(f'{list(rows.shape)} rows for a grid of {tiles} tiles of {tile_rows}')
    if out is None:
        out = np.zeros(shape, rows.dtype)
    elif out.shape != shape:
        raise ValueError(f'the output is {list(out.shape)}, not {list(shape)}')
    tiles_first = tiles - 1 if grid_rows else 1
    out.reshape(-1, tile_rows, hidden)[:tiles_first] = rows[:tiles_first * tile_rows].reshape(
        tiles_first, tile_rows, hidden)
    if grid_rows:
        out[grid_rows, 0] = rows[tiles_first * tile_rows:]
    return out


def encoded_rows(array: np.ndarray) -> np.ndarray:
    """Return the embedding rows [tiles * tile_rows, hidden] of an image in its wire form."""
    grid_rows, cols, tile_rows, hidden = array.shape
    if grid_rows == 1:
        return array.reshape(-1, hidden)
    tiles = array[:grid_rows - 1].reshape(-1, hidden)
    return np.concatenate([tiles, array[grid_rows - 1, 0]])


def lay_out(texts: Sequence[str], placements: Sequence[Placement], encode_first, encode
            ) -> MediaPrompt:
    """Tokenize the text pieces between the markers and put each image's items between them.

    texts: the prompt split at its markers (one piece more than images); encode_first
    tokenizes the first piece (with BOS as the prompt wants it), encode the others.
    """
    ids: List[int] = []
    image_at: List[int] = []
    for i, text in enumerate(texts):
        ids += (encode_first if i == 0 else encode)(text) if text or i == 0 else []
        if i == len(placements):
            break
        image_at.append(len(ids))
        ids += item_ids(placements[i])
    return MediaPrompt(tuple(ids), spans_of(placements, image_at),
                       tuple(p.rows for p in placements), tuple(image_at))


def item_ids(placement: Placement) -> List[int]:
    """Return the token ids among an image's items (its wrapper tokens), in order."""
    return [i for item in placement.items if isinstance(item, tuple) for i in item]


def spans_of(placements: Sequence[Placement], image_at: Sequence[int]
             ) -> Tuple[Tuple[int, int], ...]:
    """Embedding spans (position, rows) of images whose items start at ids[image_at[i]]."""
    spans: List[Tuple[int, int]] = []
    rows = 0   # embedding rows before the current image: positions = ids index + rows
    for placement, at in zip(placements, image_at):
        pos = at + rows
        for item in placement.items:
            if isinstance(item, tuple):
                pos += len(item)
            else:
                spans.append((pos, item))
                pos += item
                rows += item
    return tuple(spans)


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
    """Content digest of an image or clip (reads the frames in place, no copy)."""
    if isinstance(image, VideoClip):
        return clip_digest([image_digest(f) for f in image.frames])
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
