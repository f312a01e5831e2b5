"""Block-quantized weights in onnxruntime's MatMulNBits layout, from GGUF blocks or floats.

MatMulNBits stores an [N, K] weight as uint8 [N, K/bs, bs*bits/8]: 4-bit codes two per byte
with element 2i in the low nibble, 8-bit codes one per byte; one scale and one unsigned zero
point per block: w = scale * (q - zero_point).

Exact repacks (no requantization):
- GGUF Q4_0 (w = d * (q - 8)): scale d, zero point 8.
- GGUF Q8_0 (w = d * q, q int8): 8-bit code q + 128, zero point 128.
- GGUF Q4_1 (w = d * q + m): needs a float zero point -m/d, which onnxruntime's fast CPU
  kernel does not take (it then dequantizes the whole matrix on every call, ~100x slower),
  so it is kept as q, d, the nearest integer zero point z plus a per-block additive
  `offset` m + d*z. The graph either adds block_sum(x) @ offsets.T exactly or, with
  fold_offsets, folds the offsets into extra 4-bit blocks of the same MatMulNBits. `exact=False`
  re-quantizes it instead.
- Every other GGUF block type with a uniform grid (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) is
  affine per sub-block, w = s * code + o, and is repacked the same way at its own sub-block
  size (16 or 32): codes kept, 4-bit storage for codes of <= 4 bits, 8-bit above; an integer
  zero point where -o/s is one (Q3_K, Q5_0, Q6_K), else the Q4_1 form with offsets (Q2_K,
  Q4_K, Q5_1, Q5_K). IQ4_NL / IQ4_XS (a non-uniform 16-value int8 grid times a scale) are
  exact as 8-bit codes grid + 128. The scales and offsets are read back through gguf's own
  dequantizer (probe blocks with every code set to 0 and to 1), so no bit layout is decoded
  twice; they are exact up to float32 rounding of s = w(1) - w(0).
Everything else (and wide types under precision='int4') is dequantized with gguf's own
dequantizer and re-quantized (asymmetric).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.convert.checkpoint import SourceTensor
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import PRECISIONS

# Source types with more than 4 bits per weight: kept at 8 bits under precision='source'
# (float sources too: 4-bit would not be the near-exact default the converter promises).
WIDE_TYPES = ('Q5_0', 'Q5_1', 'Q5_K', 'Q6_K', 'Q8_0', 'IQ4_NL', 'IQ4_XS', 'F32', 'F16', 'BF16')
_SLAB_ELEMENTS = 1 << 22


@dataclass
class BlockWeights:
    """An [N, K] weight as block-quantized 4- or 8-bit codes.

    packed: uint8 [N, K/bs, bs*bits/8] (MatMulNBits order); scales: float32 [N, K/bs];
    zero_points: uint8 [N, K/bs] (unpacked); offsets: float32 [N, K/bs] or None, added to
    every element of its block (w = scale * (q - zp) + offset).
    """

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    block_size: int
    bits: int = 4
    offsets: Optional[np.ndarray] = None

    @property
    def shape(self) -> tuple:
        return (self.packed.shape[0], self.packed.shape[1] * self.block_size)

    def codes(self) -> np.ndarray:
        """Unpacked codes, uint8 [N, K]."""
        if self.bits == 8:
            return self.packed.reshape(self.shape)
        lo = self.packed & np.uint8(0x0F)
        hi = self.packed >> np.uint8(4)
        return np.stack([lo, hi], axis=-1).reshape(self.shape)

    def dequantize(self) -> np.ndarray:
        """Float32 [N, K] exactly as the graph computes the weight."""
        n, k = self.shape
        nb = k // self.block_size
        q = self.codes().reshape(n, nb, self.block_size).astype(np.float32)
        w = (q - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(n, k)

    def packed_zero_points(self) -> np.ndarray:
        """Zero points as MatMulNBits wants them (4-bit: two per byte, low nibble first)."""
        zp = self.zero_points
        if self.bits == 8:
            return zp
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
        return (zp[:, 0::2] | (zp[:, 1::2] << np.uint8(4))).astype(np.uint8)

    def default_zero_points(self) -> bool:
        """Tell whether every zero point is 2**(bits-1), MatMulNBits' value when none is given.

        True for GGUF Q4_0 (8) and Q8_0 (128) repacks. Leaving that input out selects
        onnxruntime's symmetric kernels: same results, ~10% faster decode on SmolLM2 (Q8_0
        lm_head).
        """
        return bool((self.zero_points == 1 << (self.bits - 1)).all())

    def nbytes(self) -> int:
        """Bytes the graph stores (and reads per full matmul) for this weight (fp32 scales)."""
        total = self.packed.nbytes + self.scales.nbytes + self.packed_zero_points().nbytes
        return total + (0 if self.offsets is None else self.offsets.nbytes)


def pack_codes(codes: np.ndarray, block_size: int, bits: int = 4) -> np.ndarray:
    """Pack uint8 codes [N, K] into MatMulNBits' [N, K/bs, bs*bits/8]."""
    n, k = codes.shape
    if bits == 8:
        return codes.astype(np.uint8).reshape(n, k // block_size, block_size)
    c = codes.astype(np.uint8).reshape(n, k // 2, 2)
    return (c[..., 0] | (c[..., 1] << np.uint8(4))).reshape(n, k // block_size, block_size // 2)


def _ggml_q4_codes(qs: np.ndarray) -> np.ndarray:
    """GGML 4-bit codes [rows, nb, 16 bytes] -> [rows, nb, 32]: byte j holds j and j+16."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """Read the little-endian fp16 at byte `start` of every block, as float32."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def from_q4_0(raw: np.ndarray, cols: int) -> BlockWeights:
    """Repack GGUF Q4_0 blocks (w = d * (q - 8)) losslessly."""
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // 32, 18)
    d = _f16(blocks, 0)
    codes = _ggml_q4_codes(blocks[..., 2:]).reshape(rows, cols)
    return BlockWeights(pack_codes(codes, 32), d, np.full(d.shape, 8, np.uint8), 32)


def from_q4_1(raw: np.ndarray, cols: int, exact: bool = True) -> BlockWeights:
    """Repack GGUF Q4_1 blocks (w = d * q + m): exact with offsets, or re-quantized.

    Exact form: w = d * (q - z) + (m + d * z) with the integer zero point z nearest -m/d, so
    the matmul sees centred codes (as for Q4_0: int8 activation rounding is not amplified)
    and the per-block offset left for the graph to add is at most d/2.
    """
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // 32, 20)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    codes = _ggml_q4_codes(blocks[..., 4:]).reshape(rows, cols)
    if exact:
        z = np.clip(np.rint(-m / np.where(d != 0, d, 1.0)), 0, 15)
        z = np.where(d != 0, z, 0.0)
        return BlockWeights(pack_codes(codes, 32), d, z.astype(np.uint8), 32,
                            offsets=(m + d * z).astype(np.float32))
    w = codes.reshape(rows, cols // 32, 32).astype(np.float32) * d[..., None] + m[..., None]
    return quantize_blocks(w.reshape(rows, cols), 32, 4)


def from_q8_0(raw: np.ndarray, cols: int) -> BlockWeights:
    """Repack GGUF Q8_0 blocks (w = d * q, q int8) losslessly as 8-bit codes q + 128."""
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // 32, 34)
    d = _f16(blocks, 0)
    q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    return BlockWeights(q.astype(np.uint8), d, np.full(d.shape, 128, np.uint8), 32, bits=8)


@dataclass(frozen=True)
class BlockLayout:
    """Where a GGML block type keeps its codes, for the probes of from_affine_blocks.

    code_bytes: (start, stop, byte value) ranges of each block that hold the codes: all-zero
    bytes give every element raw code 0; the given values give raw code 1 (0x11: two nibbles,
    0x55: four 2-bit fields, 0 for high-bit planes). grid: codes index IQ4's int8 value grid.
    """

    sub: int
    code_bits: int
    code_bytes: Tuple[Tuple[int, int, int], ...]
    grid: bool = False

    @property
    def storage_bits(self) -> int:
        return 8 if self.grid or self.code_bits > 4 else 4


# ggml-common.h block structs (byte offsets inside one block).
EXACT_LAYOUTS: Dict[str, BlockLayout] = {
    'Q5_0': BlockLayout(32, 5, ((2, 6, 0), (6, 22, 0x11))),
    'Q5_1': BlockLayout(32, 5, ((4, 8, 0), (8, 24, 0x11))),
    'Q2_K': BlockLayout(16, 2, ((16, 80, 0x55),)),
    'Q3_K': BlockLayout(16, 3, ((0, 32, 0), (32, 96, 0x55))),
    'Q4_K': BlockLayout(32, 4, ((16, 144, 0x11),)),
    'Q5_K': BlockLayout(32, 5, ((16, 48, 0), (48, 176, 0x11))),
    'Q6_K': BlockLayout(16, 6, ((0, 128, 0x11), (128, 192, 0))),
    'IQ4_NL': BlockLayout(32, 4, ((2, 18, 0),), grid=True),
    'IQ4_XS': BlockLayout(32, 4, ((8, 136, 0),), grid=True),
}
_IQ4_GRID_FIRST = -127  # kvalues_iq4nl[0]: the value raw code 0 selects


def from_affine_blocks(raw: np.ndarray, cols: int, qtype: str) -> BlockWeights:
    """Repack GGML blocks of a type in EXACT_LAYOUTS without requantizing (see the module)."""
    import gguf
    layout = EXACT_LAYOUTS[qtype]
    gtype = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[gtype]
    rows = raw.shape[0]
    blocks = np.asarray(raw).reshape(rows, cols // block, size)
    sub, nsub = layout.sub, cols // layout.sub

    def dequant(b: np.ndarray) -> np.ndarray:
        w = gguf.quants.dequantize(b.reshape(rows, -1), gtype)
        return np.asarray(w, np.float32).reshape(rows, nsub, sub)

    def probe(code: int) -> np.ndarray:
        b = blocks.copy()
        for start, stop, value in layout.code_bytes:
            b[..., start:stop] = value if code else 0
        return dequant(b)[..., 0]  # one value per sub-block: every code is the same

    w = dequant(blocks)
    w0 = probe(0)
    if layout.grid:
        scale = w0 / np.float32(_IQ4_GRID_FIRST)
        safe = np.where(scale != 0, scale, 1)[..., None]
        codes = np.rint(w / safe) + 128
        codes = np.where(scale[..., None] != 0, codes, 128)
        return BlockWeights(pack_codes(codes.reshape(rows, cols).astype(np.uint8), sub, 8),
                            scale.astype(np.float32), np.full(scale.shape, 128, np.uint8),
                            sub, 8)
    scale = probe(1) - w0
    safe = np.where(scale != 0, scale, 1)
    codes = np.where(scale[..., None] != 0, np.rint((w - w0[..., None]) / safe[..., None]), 0)
    bits = layout.storage_bits
    top = (1 << bits) - 1
    zf = -w0 / safe
    z = np.where(scale != 0, np.rint(zf), 0)
    if np.all((np.abs(zf - z) <= 1e-3) | (scale == 0)) and np.all(w0[scale == 0] == 0):
        # Symmetric about an integer code: a plain zero point, no offsets. Codes are shifted
        # so the zero point is 2**(bits-1), MatMulNBits' default (symmetric kernels), when
        # they fit.
        mid = 1 << (bits - 1)
        shifted = codes + (mid - z[..., None])
        if shifted.min() >= 0 and shifted.max() <= top:
            codes, z = shifted, np.full(z.shape, float(mid))
        return BlockWeights(pack_codes(codes.reshape(rows, cols).astype(np.uint8), sub, bits),
                            scale.astype(np.float32), z.astype(np.uint8), sub, bits)
    z = np.clip(z, 0, top)
    return BlockWeights(pack_codes(codes.reshape(rows, cols).astype(np.uint8), sub, bits),
                        scale.astype(np.float32), z.astype(np.uint8), sub, bits,
                        offsets=(w0 + scale * z).astype(np.float32))


def quantize_blocks(w: np.ndarray, block_size: int, bits: int = 4,
                    shrink: Sequence[float] = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85)
                    ) -> BlockWeights:
    """Asymmetric round-to-nearest per block, picking the clip range of least squared error.

    The range always includes 0 (zero points are unsigned codes); a few shrink factors of
    it are tried because clipping a rare outlier often lowers the block's total error.
    """
    n, k = w.shape
    if k % block_size:
        raise ValueError(f'K={k} is not a multiple of block size {block_size}')
    qmax = float((1 << bits) - 1)
    x = np.asarray(w, np.float32).reshape(n, k // block_size, block_size)
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = np.maximum(x.max(axis=-1), 0.0)
    best = None
    for f in (shrink if bits == 4 else (1.0,)):
        scale = (hi - lo) * f / qmax
        safe = np.where(scale > 0, scale, 1.0)
        zp = np.clip(np.rint(-lo * f / safe), 0, qmax)
        q = np.clip(np.rint(x / safe[..., None]) + zp[..., None], 0, qmax)
        err = (((q - zp[..., None]) * scale[..., None] - x) ** 2).sum(axis=-1)
        if best is None:
            best = [err, q, scale, zp]
            continue
        better = err < best[0]
        best = [np.where(better, err, best[0]), np.where(better[..., None], q, best[1]),
                np.where(better, scale, best[2]), np.where(better, zp, best[3])]
    _, q, scale, zp = best
    return BlockWeights(pack_codes(q.reshape(n, k).astype(np.uint8), block_size, bits),
                        scale.astype(np.float32), zp.astype(np.uint8), block_size, bits)


def repack_plan(qtype: str, block_size: int = 32, precision: str = 'source',
                exact: bool = True) -> Tuple[str, int]:
    """How to_blocks stores a matrix of `qtype`: (how, bits).

    how: 'exact' (the file's own codes and scales, repacked) or 'requantized' (dequantized,
    then quantized again to `bits`: lossy).
    """
    bits = 8 if precision == 'source' and qtype in WIDE_TYPES else 4
    if block_size != 32:
        return 'requantized', bits
    if qtype in ('Q4_0', 'Q4_1') or (qtype == 'Q8_0' and bits == 8):
        return ('requantized' if qtype == 'Q4_1' and not exact else 'exact'), bits
    layout = EXACT_LAYOUTS.get(qtype)
    return ('exact' if layout is not None and layout.storage_bits <= bits
            else 'requantized'), bits


def to_blocks(t: SourceTensor, block_size: int = 32, precision: str = 'source',
              exact: bool = True) -> BlockWeights:
    """Convert a 2-D source tensor; exact repacks where the source blocks allow it.

    precision='source' keeps types wider than 4 bits (Q5_*, Q6_K, Q8_0) at 8 bits;
    'int4' makes every matrix 4-bit.
    """
    if len(t.shape) != 2:
        raise ValueError(f'{t.name}: expected a matrix, got shape {t.shape}')
    if precision not in PRECISIONS:
        raise ValueError(f'precision must be one of {PRECISIONS}')
    cols = t.shape[1]
    how, bits = repack_plan(t.qtype, block_size, precision, exact)
    if t.permute_heads or t.row_order is not None:
        # llama Q/K rows (llama.cpp's permutation undone), qwen35's gathered rows: once, here
        t = SourceTensor(t.name, t.qtype, t.shape, t.values(), shift=t.shift)
    if block_size == 32 and t.qtype == 'Q4_0':
        return from_q4_0(t.data, cols)
    if block_size == 32 and t.qtype == 'Q4_1':
        return from_q4_1(t.data, cols, exact=exact)
    if block_size == 32 and t.qtype == 'Q8_0' and bits == 8:
        return from_q8_0(t.data, cols)
    # Dequantize (and requantize or probe) a slab of rows at a time: a large embedding as
    # float32 plus the temporaries would otherwise need several GB.
    step = max(1, _SLAB_ELEMENTS // cols)
    if how == 'exact':
        with np.errstate(invalid='ignore', divide='ignore'):  # NaN scales: reported below
            slabs = [from_affine_blocks(t.data[i:i + step], cols, t.qtype)
                     for i in range(0, t.shape[0], step)]
        out = slabs[0] if len(slabs) == 1 else concat_rows(slabs)[0]
        if not (np.isfinite(out.scales).all() and
                (out.offsets is None or np.isfinite(out.offsets).all())):
            raise ModelLoadError(f'tensor {t.name!r} ({t.qtype}) has block scales that are not '
                                 'finite: the file is corrupt; download or convert it again')
        return out
    slabs = [quantize_blocks(t.rows(i, min(i + step, t.shape[0])).dequantize(), block_size,
                             bits) for i in range(0, t.shape[0], step)]
    return slabs[0] if len(slabs) == 1 else concat_rows(slabs)[0]


def concat_rows(parts: Sequence[BlockWeights]) -> Sequence[BlockWeights]:
    """Stack weights along N (fused Q/K/V or gate/up) when their formats agree.

    Returns one fused BlockWeights, or the parts unchanged when bit widths differ (the graph
    then runs them as separate matmuls). Offsets become zero rows where a part has none.
    """
    if len({(p.block_size, p.bits) for p in parts}) != 1:
        return list(parts)
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None
                                  else np.zeros(p.scales.shape, np.float32) for p in parts])
    first = parts[0]
    return [BlockWeights(np.concatenate([p.packed for p in parts]),
                         np.concatenate([p.scales for p in parts]),
                         np.concatenate([p.zero_points for p in parts]),
                         first.block_size, first.bits, offsets)]


def fold_offsets(w: BlockWeights, levels: int = 2) -> Tuple[BlockWeights, int]:
    """Fold per-block offsets into extra 4-bit blocks: returns (W' without offsets, copies).

    x @ W.T == x' @ W'.T where x' = [x, m, m, ...] appends `copies` copies of the block means
    m_b = mean(x[b*bs:(b+1)*bs]), and W' holds, after column K, each offset times bs as a
    sum of `levels` 4-bit refinements (level 1 quantizes a row's offsets with one scale per
    extra block, level 2 quantizes what level 1 left, ...). Copy positions that no level uses
    get weight 0. Each offset is then off by at most its row's range (including 0) /
    (2 * 15**levels): at
    levels=2 about 0.1% of the largest offset, far below the int8 rounding of activations that
    accuracy_level 4 adds, while the offset term costs no extra matmul, only ~2 more blocks
    per row for the kernel (K' = K + copies * K/bs, the last block may be partial).
    """
    if w.offsets is None:
        raise ValueError('fold_offsets needs a weight with offsets')
    if w.bits != 4 or levels < 1:
        raise ValueError('fold_offsets folds into 4-bit blocks at levels >= 1')
    n, k = w.shape
    bs = w.block_size
    nb = k // bs
    copies, plan = _fold_layout(nb, bs, levels)
    n_ext = len(plan)
    codes = np.zeros((n, n_ext, bs), np.uint8)
    scales = np.zeros((n, n_ext), np.float32)
    zps = np.zeros((n, n_ext), np.uint8)
    left = w.offsets.astype(np.float64)  # what the levels so far have not represented
    for level in range(levels):
        represented = np.zeros_like(left)
        for e, (lvl, slots) in enumerate(plan):
            if lvl != level:
                continue
            cols = [j for _, j in slots]
            q, scale, zp = _quantize_rows_4bit(left[:, cols])
            codes[:, e, :] = zp[:, None]  # unused positions: code == zero point, weight 0
            codes[:, e, [pos for pos, _ in slots]] = q
            scales[:, e] = scale * bs  # the input carries block means, not sums
            zps[:, e] = zp
            represented[:, cols] = (q.astype(np.float64) - zp[:, None]) * scale[:, None]
        left = left - represented
    return BlockWeights(np.concatenate([w.packed, pack_codes(codes.reshape(n, -1), bs)], axis=1),
                        np.concatenate([w.scales, scales], axis=1),
                        np.concatenate([w.zero_points, zps], axis=1), bs, 4), copies


def _fold_layout(nb: int, bs: int, levels: int) -> Tuple[int, List[Tuple[int, list]]]:
    """Place `levels` full sets of the nb block means into blocks of `copies` appended copies.

    Returns copies and, per extra block, (level or -1 if unused, [(position in block, j)]):
    every level has each j exactly once, in blocks of that level only (a block has one scale).
    Greedy: the fewest copies for which each level can take whole blocks covering all j (a
    small nb needs many: one block must not hold two levels' copies).
    """
    for copies in range(levels, levels * (bs // nb + 2) + 1):
        ext = copies * nb
        blocks = [[(p - b * bs, p % nb) for p in range(b * bs, min(ext, (b + 1) * bs))]
                  for b in range(-(-ext // bs))]
        plan: List[Tuple[int, list]] = [(-1, []) for _ in blocks]
        for level in range(levels):
            need = set(range(nb))
            while need:
                free = [b for b in range(len(blocks)) if plan[b][0] < 0]
                gain = [len(need & {j for _, j in blocks[b]}) for b in free]
                if not free or max(gain) == 0:
                    break
                best = free[gain.index(max(gain))]
                slots = {}
                for pos, j in blocks[best]:
                    if j in need:
                        slots.setdefault(j, pos)
                plan[best] = (level, sorted((pos, j) for j, pos in slots.items()))
                need -= set(slots)
            if need:
                break
        else:
            return copies, plan
    raise ValueError(f'no layout for {levels} offset levels over {nb} blocks')


def _quantize_rows_4bit(v: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric round-to-nearest 4-bit codes per row of v [N, n] (range includes 0)."""
    lo = np.minimum(v.min(axis=1), 0.0)
    hi = np.maximum(v.max(axis=1), 0.0)
    scale = ((hi - lo) / 15.0).astype(np.float32).astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    zp = np.clip(np.rint(-lo / safe), 0, 15)
    q = np.clip(np.rint(v / safe[:, None]) + zp[:, None], 0, 15)
    return q.astype(np.uint8), scale.astype(np.float32), zp.astype(np.uint8)
