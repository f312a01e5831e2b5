"""Image preprocessing of the mmproj families as llama.cpp's multimodal library does it.

The encoder's embeddings depend on the exact pixels, so each family resizes as the libmtmd this
project is checked against (llama-cpp-python 0.3.36's, tools/mtmd/mtmd-image.cpp) does. Its
resamplers match Pillow's antialiased filters (bicubic with a = -0.5), one pass per axis, the
width first, so Pillow does the resampling here (test/test_vision_encoder.py compares the
embeddings of every chunk with libmtmd's):
- gemma3: one tile, the image letterboxed on black (scaled to fit, rounded up, centred at floor
  offsets) with Pillow's BILINEAR;
- idefics3: as HF's Idefics3 processor, with LANCZOS: the longest edge scaled to
  `longest_edge` (the other edge truncated, then made even), then both edges up to whole
  tiles; the tiles row by row, then the overview (that image resized to one tile);
- internvl: an image no larger than one tile is stretched to it (BICUBIC), the only chunk. A
  larger one takes the grid of a x b tiles (libmtmd's candidates: a * b <= max_tiles, not HF's
  closest aspect ratio) that keeps most of its pixels, the least wasted area breaking ties; it
  is letterboxed on black into that grid (BICUBIC) and cut row by row, and the whole image
  stretched to one tile (BICUBIC) follows as the thumbnail;
- mlp (LLaVA-1.5): one tile, letterboxed as gemma3's but BICUBIC and on libmtmd's fixed grey
  (122, 116, 104), whatever the mmproj's image_mean (no mean colour of the image is taken);
- qwen2.5vl / qwen3vl and gemma4v: one image of its own size, letterboxed (BICUBIC) into
  sides that are multiples of patch x merge (2 for Qwen-VL, 3 for Gemma 4) within the
  family's token limits (runtime/mmproj_qwen.py's smart_size).
`preprocess` picks the recipe from model.yaml's `vision` mapping, `grid_for` gives the tile
count of an image size without its pixels. The tiles stay uint8: vision.onnx normalizes them
((u8 / 255 - mean) / std, convert/vision_graph.py).
(The recipes in docs/design/issue22_mmproj_research.md section 2 describe an older libmtmd:
its own bilinear and bicubic kernels. The installed library gave different pixels; this module
follows it.)
"""
from dataclasses import dataclass
from functools import lru_cache
import math
from typing import List, Mapping, Tuple

import numpy as np

BLACK = (0, 0, 0)
# libmtmd's pad colour of the mlp (LLaVA) family: CLIP's mean x 255, truncated; fixed.
LLAVA_GREY = (122, 116, 104)
# clip.cpp's defaults for an InternVL mmproj without clip.vision.preproc_min/max_tiles.
INTERNVL_MIN_TILES, INTERNVL_MAX_TILES = 1, 12
# model.yaml's vision.preprocess values (convert/vision_graph.py writes them).
PREPROCESS = ('letterbox_bilinear', 'idefics3_tiles', 'internvl_tiles', 'letterbox_bicubic',
              'qwen_smart_resize', 'gemma4_resize')
# One image of its own size (runtime/mmproj_qwen.py's resize; Gemma 4 with its merge of 3).
_SMART = ('qwen_smart_resize', 'gemma4_resize')


class ImageShapeError(ValueError):
    """An image that is not [H, W, 3] uint8 with H, W >= 1."""


def _check(img: np.ndarray) -> np.ndarray:
    if (not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3
            or img.shape[2] != 3 or 0 in img.shape[:2]):
        shape = tuple(getattr(img, 'shape', ()))
        raise ImageShapeError(f'an image must be [H, W, 3] uint8 RGB with H, W >= 1, got '
                              f'{getattr(img, "dtype", type(img).__name__)} {shape}')
    return img


def _resample(img: np.ndarray, width: int, height: int, name: str) -> np.ndarray:
    """Resize with Pillow's filter, the width first, then the height, as libmtmd does.

    (Pillow alone may take the height first when that is cheaper; the uint8 rounding between
    the passes then differs.)
    """
    from PIL import Image
    filt = {'bilinear': Image.BILINEAR, 'bicubic': Image.BICUBIC,
            'lanczos': Image.LANCZOS}[name]
    out = Image.fromarray(img)
    if out.width != width:
        out = out.resize((width, out.height), filt)
    if out.height != height:
        out = out.resize((width, height), filt)
    return np.array(out)


def letterbox(img: np.ndarray, width: int, height: int, resample: str,
              color: Tuple[int, int, int] = BLACK) -> np.ndarray:
    """Return img scaled to fit [height, width] (edges rounded up) and centred on `color`."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img.copy()
    scale = min(np.float32(width) / np.float32(w), np.float32(height) / np.float32(h))
    nw = min(int(math.ceil(np.float32(w) * scale)), width)
    nh = min(int(math.ceil(np.float32(h) * scale)), height)
    out = np.empty((height, width, 3), np.uint8)
    out[:] = np.asarray(color, np.uint8)
    ox, oy = (width - nw) // 2, (height - nh) // 2
    out[oy:oy + nh, ox:ox + nw] = _resample(img, nw, nh, resample)
    return out


@dataclass(frozen=True)
class Tiles:
    """An image's tiles in llama.cpp's chunk order, and the grid they came from."""

    tiles: List[np.ndarray]  # [S, S, 3] uint8 each: the grid row by row, then the overview
    grid: Tuple[int, int]    # (columns, rows); (0, 0) for a single tile without a grid


def gemma3_tiles(img: np.ndarray, size: int) -> Tiles:
    """Return gemma3's one tile: letterboxed on black with the bilinear."""
    return Tiles([letterbox(_check(img), size, size, 'bilinear')], (0, 0))


def _longest_edge_size(w: int, h: int, longest: int) -> Tuple[int, int]:
    """Return HF Idefics3's size with the longest edge `longest` (the other even)."""
    if w >= h:
        nw, nh = longest, int(longest / (w / h))
        nh += nh % 2
    else:
        nw, nh = int(longest * (w / h)), longest
        nw += nw % 2
    return max(nw, 1), max(nh, 1)


def idefics3_tiles(img: np.ndarray, size: int, longest_edge: int) -> Tiles:
    """Return idefics3's tiles: the grid at whole tiles (LANCZOS), then the overview."""
    h, w = _check(img).shape[:2]
    scaled = img
    if longest_edge > 0:
        nw, nh = _longest_edge_size(w, h, longest_edge)
        scaled = _resample(img, nw, nh, 'lanczos')
    sh, sw = scaled.shape[:2]
    w_bar, h_bar = math.ceil(sw / size) * size, math.ceil(sh / size) * size
    refined = _resample(scaled, w_bar, h_bar, 'lanczos')
    tiles = [refined[y:y + size, x:x + size].copy()
             for y in range(0, h_bar, size) for x in range(0, w_bar, size)]
    tiles.append(_resample(refined, size, size, 'lanczos'))
    return Tiles(tiles, (w_bar // size, h_bar // size))


@lru_cache(maxsize=32)
def _internvl_candidates(size: int, min_tiles: int, max_tiles: int
                         ) -> Tuple[Tuple[int, int], ...]:
    """Return clip.cpp's InternVL grids (width, height) in pixels, in its order.

    a tiles across from min to max, b down from max(ceil(min / a), min) to max // a: for the
    default 1..12 every grid of at most 12 tiles, 1 x 1 included.
    """
    out = []
    for a in range(min_tiles, max_tiles + 1):
        for b in range(max(-(-min_tiles // a), min_tiles), min(max_tiles // a, max_tiles) + 1):
            out.append((a * size, b * size))
    return tuple(out)


def _best_resolution(w: int, h: int, candidates) -> Tuple[int, int]:
    """Return the candidate keeping most of the image's pixels, then wasting the least area.

    As libmtmd's select_best_resolution: the image scaled to fit each (float32, truncated);
    the first candidate wins a tie.
    """
    f32 = np.float32
    best, most, least = candidates[0], 0, math.inf
    for cw, ch in candidates:
        scale = min(f32(cw) / f32(w), f32(ch) / f32(h))
        kept = min(int(f32(w) * scale) * int(f32(h) * scale), w * h)
        waste = cw * ch - kept
        if kept > most or (kept == most and waste < least):
            best, most, least = (cw, ch), kept, waste
    return best


def _internvl_grid(h: int, w: int, size: int, min_tiles: int, max_tiles: int
                   ) -> Tuple[int, int]:
    """Return the tile grid's (width, height) in pixels; (0, 0) for an image of one tile."""
    if w <= size and h <= size:
        return 0, 0
    if not 1 <= min_tiles <= max_tiles:
        raise ValueError(f'InternVL tiles {min_tiles}..{max_tiles}: need 1 <= min <= max')
    return _best_resolution(w, h, _internvl_candidates(size, min_tiles, max_tiles))


def internvl_tiles(img: np.ndarray, size: int, min_tiles: int = INTERNVL_MIN_TILES,
                   max_tiles: int = INTERNVL_MAX_TILES) -> Tiles:
    """Return InternVL's tiles: the grid (letterboxed on black, BICUBIC), then the thumbnail.

    An image no larger than one tile is only stretched to it: one chunk, grid (0, 0).
    """
    h, w = _check(img).shape[:2]
    gw, gh = _internvl_grid(h, w, size, min_tiles, max_tiles)
    thumbnail = _resample(img, size, size, 'bicubic')  # the whole image, stretched
    if not gw:
        return Tiles([thumbnail], (0, 0))
    refined = letterbox(img, gw, gh, 'bicubic')
    tiles = [refined[y:y + size, x:x + size].copy()
             for y in range(0, gh, size) for x in range(0, gw, size)]
    tiles.append(thumbnail)
    return Tiles(tiles, (gw // size, gh // size))


def mlp_tiles(img: np.ndarray, size: int, color: Tuple[int, int, int] = LLAVA_GREY) -> Tiles:
    """Return LLaVA-1.5's one tile: letterboxed on libmtmd's grey with the bicubic."""
    return Tiles([letterbox(_check(img), size, size, 'bicubic', color)], (0, 0))


def _recipe(vision: Mapping) -> str:
    name = str(vision.get('preprocess', ''))
    if name not in PREPROCESS:
        from edge_llm_ros.errors import ModelLoadError
        raise ModelLoadError(f'model.yaml vision.preprocess {name!r} is not one of '
                             f'{", ".join(PREPROCESS)}: reconvert the model')
    return name


def _tile_range(vision: Mapping) -> Tuple[int, int]:
    return (int(vision.get('min_tiles') or INTERNVL_MIN_TILES),
            int(vision.get('max_tiles') or INTERNVL_MAX_TILES))


def preprocess(img: np.ndarray, vision: Mapping) -> Tiles:
    """Return an image's tiles as libmtmd makes them for model.yaml's `vision` mapping."""
    name, size = _recipe(vision), int(vision['image_size'])
    if name == 'letterbox_bilinear':
        return gemma3_tiles(img, size)
    if name == 'letterbox_bicubic':
        return mlp_tiles(img, size)
    if name == 'idefics3_tiles':
        return idefics3_tiles(img, size, int(vision.get('longest_edge') or 0))
    if name in _SMART:  # one image of its own size (runtime/mmproj_qwen.py)
        from edge_llm_ros.runtime.mmproj_qwen import qwen_image, token_grid
        return Tiles([qwen_image(_check(img), vision)],
                     token_grid(img.shape[0], img.shape[1], vision))
    return internvl_tiles(img, size, *_tile_range(vision))


def grid_for(height: int, width: int, vision: Mapping) -> Tuple[int, int, int]:
    """Return the (columns, rows, tiles) `preprocess` makes of a height x width image.

    From the size alone, no pixels; `tiles` counts every chunk, the overview or thumbnail
    included: (0, 0, 1) for an image of one tile.
    """
    name, size = _recipe(vision), int(vision['image_size'])
    h, w = int(height), int(width)
    if h < 1 or w < 1:
        raise ImageShapeError(f'an image must be at least 1 x 1 pixels, got {h} x {w}')
    if name in ('letterbox_bilinear', 'letterbox_bicubic'):
        return 0, 0, 1
    if name in _SMART:  # (columns, rows) of merged tokens: one image
        from edge_llm_ros.runtime.mmproj_qwen import token_grid
        return (*token_grid(h, w, vision), 1)
    if name == 'idefics3_tiles':
        longest = int(vision.get('longest_edge') or 0)
        if longest > 0:
            w, h = _longest_edge_size(w, h, longest)
        cols, rows = math.ceil(w / size), math.ceil(h / size)
        return cols, rows, cols * rows + 1
    gw, gh = _internvl_grid(h, w, size, *_tile_range(vision))
    if not gw:
        return 0, 0, 1
    cols, rows = gw // size, gh // size
    return cols, rows, cols * rows + 1
