"""Qwen2.5-VL images as llama.cpp's libmtmd prepares them: smart resize, RoPE tables, windows.

- `smart_size`: clip.cpp's calc_size_preserved_ratio for Qwen-VL (mtmd's dyn_size
  preprocessor): each side rounded to a multiple of patch x merge (28), then, where the area
  is over max_pixels or under min_pixels, both sides scaled by the square root of the ratio
  and floored (over) or ceiled (under) to multiples of 28; float32 arithmetic as clip.cpp's.
  The limits are 8 and 4096 merged tokens (clip.cpp's set_limit_image_tokens for Qwen-VL).
- `qwen_image`: the image letterboxed into that size on black (Pillow's BICUBIC, the width
  first: mmproj_preprocess.letterbox, which is libmtmd's PAD_CEIL resize).
- `encoder_inputs`: vision.onnx's `vision_cos` / `vision_sin` (ggml's GGML_ROPE_TYPE_VISION:
  pair k < d/4 turns by row x base^(-4k/d), the next d/4 by column, the angles multiplied up
  in float32 as ggml does) and the windowed layers' window layout (`window_layout`: the
  patches gathered window by window, 112 pixels a side), for the patches in merge order
  (2 x 2 blocks row by row); for Qwen3-VL (vision `position_grid`) no windows but
  `pos_index` / `pos_weight`: the learned position embeddings' bilinear interpolation from
  their square grid to the image's (ggml_interpolate with align corners, clip.cpp's
  resize_position_embeddings).
"""
import math
from typing import Dict, Mapping, Tuple

import numpy as np

from edge_llm_ros.model_format import VISION_POS_INPUTS, VISION_ROPE_INPUTS, VISION_WINDOW_INPUTS

MERGE = 2            # clip.cpp's merge_ratio for the positions and windows
WINDOW_PIXELS = 112  # clip.cpp's attn_window_size default (qwen2.5vl sets none)
MIN_TOKENS, MAX_TOKENS = 8, 4096
ROPE_BASE = 10000.0


def _round_half_away(x: np.float32) -> int:
    return int(math.floor(float(x) + 0.5))


def smart_size(height: int, width: int, patch: int, min_tokens: int = MIN_TOKENS,
               max_tokens: int = MAX_TOKENS, merge: int = MERGE) -> Tuple[int, int]:
    """Return (height, width) libmtmd resizes an image to (multiples of patch x merge).

    Qwen-VL's merge is 2; Gemma 4 (gemma4v) takes the same resize with its pooling of 3.
    """
    f32 = np.float32
    align = patch * merge
    min_pixels, max_pixels = min_tokens * align * align, max_tokens * align * align

    def by(x, how) -> int:
        return int(how(float(f32(x) / f32(align)))) * align

    w_bar = max(align, by(width, _round_half_away))
    h_bar = max(align, by(height, _round_half_away))
    if h_bar * w_bar > max_pixels:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_pixels))
        h_bar = max(align, by(f32(height) / beta, math.floor))
        w_bar = max(align, by(f32(width) / beta, math.floor))
    elif h_bar * w_bar < min_pixels:
        beta = np.sqrt(f32(min_pixels) / (f32(height) * f32(width)))
        h_bar = by(f32(height) * beta, math.ceil)
        w_bar = by(f32(width) * beta, math.ceil)
    return h_bar, w_bar


def token_grid(height: int, width: int, vision: Mapping) -> Tuple[int, int]:
    """Return the (columns, rows) of merged tokens an image of height x width becomes."""
    patch, merge = int(vision['patch_size']), int(vision.get('merge') or MERGE)
    h, w = smart_size(height, width, patch, int(vision.get('min_tokens') or MIN_TOKENS),
                      int(vision.get('max_tokens') or MAX_TOKENS), merge)
    return w // (patch * merge), h // (patch * merge)


def qwen_image(img: np.ndarray, vision: Mapping) -> np.ndarray:
    """Return the image resized as libmtmd does (uint8 [H', W', 3], sides multiples of 28).

    (Gemma 4's too: multiples of patch x 3, vision `merge`.)
    """
    from edge_llm_ros.runtime.mmproj_preprocess import letterbox
    cols, rows = token_grid(img.shape[0], img.shape[1], vision)
    side = int(vision['patch_size']) * int(vision.get('merge') or MERGE)
    return letterbox(img, cols * side, rows * side, 'bicubic')


def _merge_order(rows: int, cols: int) -> Tuple[np.ndarray, np.ndarray]:
    """Return each patch's (row, column) in merge order, for a grid of merged tokens."""
    by, bx, dy, dx = np.meshgrid(np.arange(rows), np.arange(cols), np.arange(MERGE),
                                 np.arange(MERGE), indexing='ij')
    return (by * MERGE + dy).reshape(-1), (bx * MERGE + dx).reshape(-1)


def rope_tables(rows: int, cols: int, head_dim: int) -> Tuple[np.ndarray, np.ndarray]:
    """Return cos, sin [N, head_dim / 2] of the patches in merge order (ggml's vision RoPE)."""
    y, x = _merge_order(rows, cols)
    half, quarter = head_dim // 2, head_dim // 4
    scale = np.float32(ROPE_BASE) ** np.float32(-2.0 / half)
    theta = np.empty((y.shape[0], half), np.float32)
    t_y, t_x = y.astype(np.float32), x.astype(np.float32)
    for k in range(half):
        theta[:, k] = t_y if k < quarter else t_x
        if k < quarter:
            t_y = t_y * scale
        else:
            t_x = t_x * scale
    return np.cos(theta), np.sin(theta)


def window_layout(rows: int, cols: int, patch: int
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the windowed layers' `window_index`, `window_bias`, `window_inverse`.

    The patches (merge order) gathered window by window into W windows of S slots (S the
    patches of a full 112-pixel window; the image's last row and column of windows have
    fewer): `window_index` int64 [W x S] the patch in each slot (0 in an empty one),
    `window_bias` float32 [W, S] 0 on a patch and float32 lowest on an empty slot (the keys
    attention skips), `window_inverse` int64 [N] each patch's slot. Attention within each
    window alone is the [N, N] block mask's computation without its N x N scores.
    """
    grid = max(WINDOW_PIXELS // patch // MERGE, 1)
    across = -(-cols // grid)
    count = -(-rows // grid) * across
    size = (grid * MERGE) ** 2
    uy, ux = np.meshgrid(np.arange(rows), np.arange(cols), indexing='ij')
    window = np.repeat(((uy // grid) * across + ux // grid).reshape(-1), MERGE * MERGE)
    order = np.argsort(window, kind='stable')
    filled = np.bincount(window, minlength=count)
    first = np.cumsum(filled) - filled
    slot = window[order] * size + np.arange(order.shape[0]) - first[window[order]]
    index = np.zeros(count * size, np.int64)
    index[slot] = order
    bias = np.full(count * size, np.finfo(np.float32).min, np.float32)
    bias[slot] = 0
    inverse = np.empty(order.shape[0], np.int64)
    inverse[order] = slot
    return index, bias.reshape(count, size), inverse


def _axis_weights(n_out: int, n_in: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return each output index's (lower, upper) source index and upper weight (float32).

    ggml's bilinear upscale with align corners: x = i / ((n_out - 1) / (n_in - 1)) in float32.
    """
    f32 = np.float32
    sf = f32(n_out - 1) / f32(n_in - 1) if n_out > 1 and n_in > 1 else f32(n_out) / f32(n_in)
    x = np.arange(n_out, dtype=f32) / sf
    lo = np.floor(x).astype(np.int64)
    hi = np.clip(lo + 1, 0, n_in - 1)
    lo = np.clip(lo, 0, n_in - 1)
    return lo, hi, np.clip(x - lo.astype(f32), 0, 1).astype(f32)


def position_interpolation(rows: int, cols: int, grid: int) -> Tuple[np.ndarray, np.ndarray]:
    """Return `pos_index` [N, 4] and `pos_weight` [N, 4] of the patches in merge order.

    Each patch's learned position is the bilinear mix of 4 rows of the grid x grid table
    (row y * grid + x); rows x cols are merged tokens, so the patches are twice as many a side.
    """
    y, x = _merge_order(rows, cols)
    y0, y1, dy = _axis_weights(rows * MERGE, grid)
    x0, x1, dx = _axis_weights(cols * MERGE, grid)
    y0, y1, dy, x0, x1, dx = y0[y], y1[y], dy[y], x0[x], x1[x], dx[x]
    one = np.float32(1)
    index = np.stack([y0 * grid + x0, y0 * grid + x1, y1 * grid + x0, y1 * grid + x1], 1)
    weight = np.stack([(one - dx) * (one - dy), dx * (one - dy), (one - dx) * dy, dx * dy], 1)
    return index.astype(np.int64), weight.astype(np.float32)


def encoder_inputs(image: np.ndarray, vision: Mapping) -> Dict[str, np.ndarray]:
    """Return vision.onnx's inputs beside the pixels for a resized image [H', W', 3]."""
    patch = int(vision['patch_size'])
    rows, cols = image.shape[0] // (patch * MERGE), image.shape[1] // (patch * MERGE)
    cos, sin = rope_tables(rows, cols, int(vision['head_dim']))
    feeds = {VISION_ROPE_INPUTS[0]: cos, VISION_ROPE_INPUTS[1]: sin}
    if vision.get('position_grid'):  # Qwen3-VL: learned positions, no windows
        index, weight = position_interpolation(rows, cols, int(vision['position_grid']))
        feeds.update({VISION_POS_INPUTS[0]: index, VISION_POS_INPUTS[1]: weight})
    else:
        feeds.update(zip(VISION_WINDOW_INPUTS, window_layout(rows, cols, patch)))
    return feeds
