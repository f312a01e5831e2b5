"""Image preprocessing of the mmproj families as llama.cpp's multimodal library does it.

The encoder's embeddings depend on the exact pixels, so each family resizes as the libmtmd this
project is checked against (llama-cpp-python 0.3.36's) does. Its resamplers match Pillow's
antialiased filters, so Pillow does the resampling here (test/test_vision_encoder.py compares
the embeddings of every chunk with libmtmd's):
- gemma3: one tile, the image letterboxed on black (scaled to fit, rounded up, centred at floor
  offsets) with Pillow's BILINEAR;
- idefics3: as HF's Idefics3 processor, with LANCZOS: the longest edge scaled to
  `longest_edge` (the other edge truncated, then made even), then both edges up to whole
  tiles; the tiles row by row, then the overview (that image resized to one tile).
Tiles are then normalized by convert/vision_graph.normalize. (The recipes in
docs/design/issue22_mmproj_research.md section 2 describe an older libmtmd: its own bilinear
and bicubic kernels. The installed library gave different pixels; this module follows it.)
"""
from dataclasses import dataclass
import math
from typing import List, Tuple

import numpy as np

BLACK = (0, 0, 0)


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
    filt = {'bilinear': Image.BILINEAR, 'lanczos': Image.LANCZOS}[name]
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
