"""NumPy references of the CUDA decode kernels in kernels/*.cu.

Each function computes what its kernel computes, in float64, from the same memory layout,
so a kernel's output is checked against it with a tolerance; the tests check these
references against onnxruntime's CPU contrib ops (MatMulNBits,
SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, RotaryEmbedding,
QuantizeLinear), i.e. against the path the engine runs on a CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

BLOCK = 32                  # MatMulNBits block_size the kernels are written for
ZP_NONE, ZP_PACKED_U8, ZP_FLOAT = 0, 1, 2   # the kernels' zp_kind argument


@dataclass(frozen=True)
class Int4Weights:
    """One linear layer in MatMulNBits layout (bits=4, block_size=32)."""

    packed: np.ndarray                  # uint8 [N, K/32, 16]
    scales: np.ndarray                  # float [N, K/32]
    zero_points: Optional[np.ndarray]   # uint8 [N, ceil(K/32 / 2)] | float [N, K/32] | None
    zp_kind: int

    @property
    def n(self) -> int:
        """Output features."""
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        """Input features."""
        return self.packed.shape[1] * BLOCK


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [N, K] values 0..15 -> [N, K/32, 16]; byte i = element 2i | element 2i+1 << 4."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError('K = %d is not a multiple of %d' % (k, BLOCK))
    q = q.astype(np.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, k // BLOCK, BLOCK // 2)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_nibbles: [N, K/32, 16] -> uint8 [N, K]."""
    n = packed.shape[0]
    flat = packed.reshape(n, -1)
    out = np.empty((n, flat.shape[1] * 2), np.uint8)
    out[:, 0::2] = flat & 0x0F
    out[:, 1::2] = flat >> 4
    return out


def pack_zero_points(zp: np.ndarray) -> np.ndarray:
    """uint8 [N, blocks] 0..15 -> [N, ceil(blocks/2)], low nibble first (odd count padded)."""
    n, blocks = zp.shape
    padded = np.zeros((n, blocks + blocks % 2), np.uint8)
    padded[:, :blocks] = zp
    return padded[:, 0::2] | (padded[:, 1::2] << 4)


def unpack_zero_points(packed: np.ndarray, blocks: int) -> np.ndarray:
    """Inverse of pack_zero_points."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out[:, :blocks]


def quantize_int4(w: np.ndarray, zp_kind: int = ZP_PACKED_U8,
                  dtype: type = np.float32) -> Int4Weights:
    """Quantize float [N, K] weights per block of 32 (asymmetric unless zp_kind is ZP_NONE)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK).astype(np.float64)
    if zp_kind == ZP_NONE:
        scale = np.abs(blocks).max(axis=2) / 7.0
        scale[scale == 0] = 1.0
        zero = np.full(scale.shape, 8.0)
    else:
        lo = np.minimum(blocks.min(axis=2), 0.0)
        hi = np.maximum(blocks.max(axis=2), 0.0)
        scale = (hi - lo) / 15.0
        scale[scale == 0] = 1.0
        zero = -lo / scale
        if zp_kind == ZP_PACKED_U8:
            zero = np.clip(np.rint(zero), 0, 15)
    scale = scale.astype(dtype)
    zero_stored = zero.astype(dtype) if zp_kind == ZP_FLOAT else zero
    q = np.clip(np.rint(blocks / scale.astype(np.float64)[..., None]
                        + np.asarray(zero_stored, np.float64)[..., None]), 0, 15)
    packed = pack_nibbles(q.reshape(n, k).astype(np.uint8))
    if zp_kind == ZP_PACKED_U8:
        zero_points = pack_zero_points(zero.astype(np.uint8))
    elif zp_kind == ZP_FLOAT:
        zero_points = zero_stored
    else:
        zero_points = None
    return Int4Weights(packed, scale, zero_points, zp_kind)


def dequantize_int4(weights: Int4Weights) -> np.ndarray:
    """[N, K] float64 weights: (q - zero) * scale per block."""
    n, blocks = weights.scales.shape
    q = unpack_nibbles(weights.packed).reshape(n, blocks, BLOCK).astype(np.float64)
    if weights.zp_kind == ZP_PACKED_U8:
        zero = unpack_zero_points(weights.zero_points, blocks).astype(np.float64)
    elif weights.zp_kind == ZP_FLOAT:
        zero = weights.zero_points.astype(np.float64)
    else:
        zero = np.full((n, blocks), 8.0)
    w = (q - zero[..., None]) * weights.scales.astype(np.float64)[..., None]
    return w.reshape(n, blocks * BLOCK)


def int4_gemv(x: np.ndarray, weights: Int4Weights) -> np.ndarray:
    """Compute y [N] = W x for one token x [K] (what int4_gemv_* computes)."""
    x = np.asarray(x, np.float64).reshape(-1)
    if x.shape[0] != weights.k:
        raise ValueError('x has %d values, the weights expect K = %d' % (x.shape[0], weights.k))
    return dequantize_int4(weights) @ x


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Compute x * rsqrt(mean(x^2, last axis) + eps) * weight (rmsnorm_*)."""
    x = np.asarray(x, np.float64)
    inv = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x * inv * np.asarray(weight, np.float64)


def add_rmsnorm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray,
                eps: float) -> Tuple[np.ndarray, np.ndarray]:
    """(rmsnorm(x + residual), x + residual) (add_rmsnorm_*: output and the new residual)."""
    h = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
    return rmsnorm(h, weight, eps), h


def rope_cache(max_position: int, rot_dim: int, theta: float = 10000.0
               ) -> Tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_position, rot_dim/2] with frequency theta^(-2i/rot_dim)."""
    inv_freq = theta ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray,
         interleaved: bool) -> np.ndarray:
    """Rotate x [seq, heads, head_dim] by positions [seq] (rope_*; new array)."""
    out = np.array(x, np.float64)
    half = cos_cache.shape[1]
    c = np.asarray(cos_cache, np.float64)[positions][:, None, :]   # [seq, 1, half]
    s = np.asarray(sin_cache, np.float64)[positions][:, None, :]
    if interleaved:
        a, b = out[..., 0:2 * half:2].copy(), out[..., 1:2 * half:2].copy()
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = b * c + a * s
    else:
        a, b = out[..., :half].copy(), out[..., half:2 * half].copy()
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = b * c + a * s
    return out


def kv_quantize(kv: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize kv [heads, tokens, head_dim] to int8 q and float32 scales [heads, tokens].

    This is what kv_quantize_* computes.

    Computed in float32 like the kernel: scale = max|x| / 127, q = rint(x / scale).
    """
    kv = np.asarray(kv, np.float32)
    scales = (np.abs(kv).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))[..., None]
    q = np.where(scales[..., None] > 0, np.rint(kv / safe), 0.0)
    return np.clip(q, -127, 127).astype(np.int8), scales


def kv_dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [heads, tokens, head_dim] = q * scale (kv_dequantize_*)."""
    return (q.astype(np.float32) * scales[..., None]).astype(np.float32)
