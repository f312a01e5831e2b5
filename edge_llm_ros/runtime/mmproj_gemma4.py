"""Gemma 4 (gemma4v) images as llama.cpp's libmtmd prepares them: the encoder's RoPE tables.

The resize is Qwen-VL's (runtime/mmproj_qwen.py, smart_size with the merge of 3: sides that
are multiples of patch x 3, 70 to 1120 pooled tokens, BICUBIC letterbox). `encoder_inputs`
gives vision.onnx's `vision_cos` / `vision_sin` [N, head_dim / 2] for the patches row by row
(clip.cpp's pos_x = i % columns, pos_y = i / columns): the first head_dim / 4 angles are the
column's, for the first half of each head, the next head_dim / 4 the row's, for the second
half (gemma4v.cpp: two NEOX ropes of head_dim / 2 dimensions, base 100, the second at offset
head_dim / 2). Each angle is pos x base^(-2k / (head_dim / 2)), multiplied up in float32 as
ggml's rope cache does.
"""
from typing import Dict, Mapping, Tuple

import numpy as np

from edge_llm_ros.model_format import VISION_ROPE_INPUTS

ROPE_BASE = 100.0


def _angles(pos: np.ndarray, n_dims: int, base: float) -> np.ndarray:
    """Return [N, n_dims / 2] angles: pos x base^(-2k / n_dims), ggml's float32 recurrence."""
    scale = np.float32(base) ** np.float32(-2.0 / n_dims)
    theta = np.empty((pos.shape[0], n_dims // 2), np.float32)
    t = pos.astype(np.float32)
    for k in range(n_dims // 2):
        theta[:, k] = t
        t = t * scale
    return theta


def rope_tables(rows: int, cols: int, head_dim: int, base: float = ROPE_BASE
                ) -> Tuple[np.ndarray, np.ndarray]:
    """Return cos, sin [rows x cols, head_dim / 2] of the patches row by row."""
    index = np.arange(rows * cols)
    theta = np.concatenate([_angles(index % cols, head_dim // 2, base),
                            _angles(index // cols, head_dim // 2, base)], axis=1)
    return np.cos(theta), np.sin(theta)


def encoder_inputs(image: np.ndarray, vision: Mapping) -> Dict[str, np.ndarray]:
    """Return vision.onnx's inputs beside the pixels for a resized image [H', W', 3]."""
    patch = int(vision['patch_size'])
    rows, cols = image.shape[0] // patch, image.shape[1] // patch
    cos, sin = rope_tables(rows, cols, int(vision['head_dim']),
                           float(vision.get('rope_base') or ROPE_BASE))
    return {VISION_ROPE_INPUTS[0]: cos, VISION_ROPE_INPUTS[1]: sin}
