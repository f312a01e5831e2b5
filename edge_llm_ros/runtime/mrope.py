"""M-RoPE positions (qwen2vl) of a prompt's KV positions, as llama.cpp's mtmd computes them.

Text is one position on all three sections (t = h = w: plain NEOX RoPE). An image of
nx x ny merged tokens that starts at rotary position p0 puts token j at (t, h, w) =
(p0, p0 + j // nx, p0 + j % nx) (mtmd_image_tokens_get_decoder_pos), and the text after it
continues at p0 + max(nx, ny) (mtmd_image_tokens_get_n_pos), not at p0 + nx * ny: after an
image a KV position and its rotary position differ. The KV cache still fills one slot per
token and attends causally in that order, which is llama.cpp's mask for these positions (its
M-RoPE causal mask orders an image's tokens row by row).

A span without a grid ((0, 0): prefix embeddings) advances one position a row, as text.
"""
from typing import Sequence, Tuple

import numpy as np

Span = Tuple[int, int]    # (KV position, rows)
Grid = Tuple[int, int]    # (columns, rows) of merged tokens; (0, 0): none


def positions(spans: Sequence[Span], grids: Sequence[Grid], start: int, length: int
              ) -> np.ndarray:
    """Return the rotary positions int32 [3, length] of KV positions start..start+length-1."""
    kv = np.arange(start, start + length, dtype=np.int64)
    out = np.repeat(kv[None], 3, axis=0)
    shift = np.zeros(length, dtype=np.int64)   # KV position - rotary position, as of here
    before = 0   # the shift of every span before the current one
    for (at, rows), (nx, ny) in zip(spans, grids):
        if not nx:
            continue
        inside = (kv >= at) & (kv < at + rows)
        p0 = at - before
        j = kv[inside] - at
        out[0, inside] = p0
        out[1, inside] = p0 + j // nx
        out[2, inside] = p0 + j % nx
        before += rows - max(nx, ny)
        shift[kv >= at + rows] = before
    text = np.ones(length, dtype=bool)
    for (at, rows), (nx, _) in zip(spans, grids):
        if nx:
            text &= ~((kv >= at) & (kv < at + rows))
    out[:, text] -= shift[text]
    return out.astype(np.int32)


def shifted(spans: Sequence[Span], grids: Sequence[Grid]) -> bool:
    """Tell whether any span has a grid (the rows then need their own positions)."""
    return any(nx for nx, _ in grids[:len(spans)])
