"""Block repacking: GGUF blocks -> MatMulNBits layout, checked against gguf's own dequantizer.

Q4_0, Q4_1, Q8_0 and every other uniform-grid type (Q5_0, Q5_1, Q2_K..Q6_K) and IQ4_NL/XS
must be exact repacks (no requantization) under precision 'source'; float sources and wide
types under 'int4' are dequantized with gguf and requantized, with an error bound per block.
The layout itself (nibble order, zero-point packing) is checked by running onnxruntime's
MatMulNBits and GatherBlockQuantized on the packed arrays. Folded Q4_1 offsets (extra 4-bit
blocks fed the block means) must reproduce each offset within the stated bound, also
through MatMulNBits.
"""
import gguf
from gguf_fixtures import random_blocks
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest

from edge_llm_ros.convert.checkpoint import SourceTensor, unpermute_llama_rows
from edge_llm_ros.convert.quant import (concat_rows, EXACT_LAYOUTS, fold_offsets, from_q4_0,
                                        from_q4_1, from_q8_0, quantize_blocks, to_blocks)
from edge_llm_ros.errors import ModelLoadError

Q = gguf.GGMLQuantizationType
ROWS, COLS = 48, 256


def weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    w[3, :32] = 0.0             # an all-zero block (scale 0)
    w[5, 32:64] = 0.25          # a constant block
    w[7, 64:96] += 0.3          # a block that does not straddle zero
    return w


def source(w: np.ndarray, qtype: str) -> SourceTensor:
    raw = gguf.quants.quantize(w, Q[qtype]) if qtype not in ('F32', 'F16') else \
        w.astype(np.float16 if qtype == 'F16' else np.float32)
    return SourceTensor('t', qtype, w.shape, raw)


def gguf_dequant(t: SourceTensor) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), Q[t.qtype]).reshape(t.shape)


def test_q4_0_repack_is_bit_exact():
    t = source(weights(), 'Q4_0')
    b = from_q4_0(t.data, COLS)
    assert b.bits == 4 and b.offsets is None
    assert (b.zero_points == 8).all()
    np.testing.assert_array_equal(b.dequantize(), gguf_dequant(t))


def test_q8_0_repack_is_bit_exact():
    t = source(weights(1), 'Q8_0')
    b = from_q8_0(t.data, COLS)
    assert b.bits == 8 and (b.zero_points == 128).all()
    np.testing.assert_array_equal(b.dequantize(), gguf_dequant(t))


def test_q4_1_exact_repack_matches_gguf():
    t = source(weights(2), 'Q4_1')
    b = from_q4_1(t.data, COLS, exact=True)
    ref = gguf_dequant(t)
    # d*(q - z) + (m + d*z) vs d*q + m: only float32 rounding differs.
    np.testing.assert_allclose(b.dequantize(), ref, rtol=0, atol=2e-7)
    # The zero point is the integer nearest -m/d, so (unless -m/d falls outside 0..15, as
    # for the constant and the all-positive block) the leftover offset is at most d/2.
    inside = (b.zero_points > 0) & (b.zero_points < 15)
    assert inside.mean() > 0.9
    assert (np.abs(b.offsets)[inside] <= 0.5 * b.scales[inside] + 1e-7).all()


def with_means(x: np.ndarray, copies: int, width: int) -> np.ndarray:
    """Build the folded weight's input: [x, block means * copies], zero-padded to `width`."""
    means = x.reshape(x.shape[0], -1, 32).mean(-1)
    xp = np.concatenate([x] + [means] * copies, axis=1)
    return np.concatenate([xp, np.zeros((x.shape[0], width - xp.shape[1]))], axis=1)


@pytest.mark.parametrize('cols', [32, 96, COLS, 576, 1536])
@pytest.mark.parametrize('levels', [1, 2, 3])
def test_folded_offsets_reproduce_each_offset_within_bound(cols, levels):
    w = np.random.default_rng(cols).standard_normal((ROWS, cols)).astype(np.float32) * 0.05
    b = from_q4_1(source(w, 'Q4_1').data, cols, exact=True)
    f, copies = fold_offsets(b, levels)
    nb = cols // 32
    assert f.offsets is None and f.shape[1] >= cols + copies * nb
    # The main blocks are untouched.
    np.testing.assert_array_equal(f.dequantize()[:, :cols], b.dequantize() - np.repeat(
        b.offsets, 32, axis=1))
    # Offset of block j as the folded weight sees it: feed x = ones over block j only.
    eye = np.repeat(np.eye(nb), 32, axis=1)
    seen = with_means(eye, copies, f.shape[1])[:, cols:] @ f.dequantize()[:, cols:].T.astype(
        np.float64) / 32
    rng = b.offsets.max(1, initial=0) - b.offsets.min(1, initial=0)  # range including 0
    bound = rng / (2 * 15 ** levels) * 1.01 + 1e-8
    assert (np.abs(seen.T - b.offsets) <= bound[:, None]).all()


def test_matmulnbits_runs_folded_offsets_with_a_partial_last_block():
    cols = 576  # 18 block means: K' = 576 + 3 * 18 is not a multiple of 32
    w = np.random.default_rng(5).standard_normal((ROWS, cols)).astype(np.float32) * 0.05
    b = from_q4_1(source(w, 'Q4_1').data, cols, exact=True)
    f, copies = fold_offsets(b, 2)
    k = cols + copies * cols // 32
    assert k % 32
    node = helper.make_node('MatMulNBits', ['A', 'B', 'S', 'Z'], ['Y'], domain='com.microsoft',
                            K=k, N=ROWS, bits=4, block_size=32, accuracy_level=0)
    sess = _session(node, [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
                    [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', ROWS])],
                    [numpy_helper.from_array(f.packed, 'B'),
                     numpy_helper.from_array(f.scales, 'S'),
                     numpy_helper.from_array(f.packed_zero_points(), 'Z')])
    x = np.random.default_rng(6).standard_normal((3, cols))
    xp = with_means(x, copies, f.shape[1])
    got = sess.run(None, {'A': xp[:, :k].astype(np.float32)})[0]
    np.testing.assert_allclose(got, xp @ f.dequantize().T, rtol=1e-4, atol=1e-5)
    # ... which is x @ W.T of the exact weight, up to the folded offsets' rounding.
    exact = x @ b.dequantize().T
    assert np.abs(got - exact).max() <= 1e-3 * np.abs(exact).max()


def test_fold_offsets_needs_4_bit_offsets():
    with pytest.raises(ValueError, match='offsets'):
        fold_offsets(from_q4_0(source(weights(4), 'Q4_0').data, COLS))


def test_q4_1_requantized_is_lossy_but_bounded():
    t = source(weights(3), 'Q4_1')
    b = from_q4_1(t.data, COLS, exact=False)
    assert b.offsets is None
    ref = gguf_dequant(t).reshape(ROWS, -1, 32)
    step = (np.maximum(ref.max(-1), 0) - np.minimum(ref.min(-1), 0)) / 15
    err = np.abs(b.dequantize().reshape(ROWS, -1, 32) - ref).max(-1)
    assert (err <= 3 * step + 1e-7).all()


@pytest.mark.parametrize('qtype,precision', [('F16', 'source'), ('F32', 'source'),
                                             ('F16', 'int4'), ('F32', 'int4'),
                                             ('Q5_0', 'int4'), ('Q5_1', 'int4')])
def test_requantized_types_error_bound(qtype, precision):
    t = source(weights(4), qtype)
    b = to_blocks(t, 32, precision)
    assert b.bits == (8 if precision == 'source' else 4)
    _check_requant(b, gguf_dequant(t) if qtype.startswith('Q') else t.dequantize())


def _random_blocks(qtype: str, rows: int, cols: int, seed: int) -> SourceTensor:
    """Return valid blocks of a type gguf-py cannot encode (K-quants, IQ4), random."""
    if qtype in ('Q5_0', 'Q5_1'):
        return source(weights(seed), qtype)
    raw = random_blocks(rows, cols, qtype, 0.05, np.random.default_rng(seed))
    return SourceTensor('k', qtype, (rows, cols), raw)


# (bits, block size, per-block offsets) of each exact form under precision 'source'.
EXACT_FORMS = {'Q5_0': (8, 32, False), 'Q5_1': (8, 32, True), 'Q2_K': (4, 16, True),
               'Q3_K': (4, 16, False), 'Q4_K': (4, 32, True), 'Q5_K': (8, 32, True),
               'Q6_K': (8, 16, False), 'IQ4_NL': (8, 32, False), 'IQ4_XS': (8, 32, False)}


@pytest.mark.parametrize('qtype', sorted(EXACT_LAYOUTS))
def test_uniform_grid_and_iq4_types_repack_exactly(qtype):
    t = _random_blocks(qtype, ROWS, COLS, seed=5)
    b = to_blocks(t, 32, 'source')
    bits, block, has_offsets = EXACT_FORMS[qtype]
    assert (b.bits, b.block_size, b.offsets is not None) == (bits, block, has_offsets)
    ref = gguf_dequant(t)
    np.testing.assert_allclose(b.dequantize(), ref, rtol=0, atol=2e-7 * np.abs(ref).max())
    if not has_offsets:  # symmetric about the kernels' default zero point
        assert b.default_zero_points()


@pytest.mark.parametrize('qtype', ['Q6_K', 'Q5_K', 'IQ4_XS'])
def test_wide_types_under_int4_are_requantized(qtype):
    t = _random_blocks(qtype, 16, 512, seed=5)
    b = to_blocks(t, 32, 'int4')
    assert b.bits == 4 and b.shape == (16, 512)
    _check_requant(b, gguf_dequant(t))


def test_corrupt_block_scales_name_the_tensor():
    t = _random_blocks('Q6_K', 4, 256, seed=1)
    t.data[0, 208:210] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    with pytest.raises(ModelLoadError, match=r"tensor 'k' \(Q6_K\).*not finite"):
        to_blocks(t, 32, 'source')


def _check_requant(b, ref: np.ndarray) -> None:
    """Requantized blocks: RMS error within ~a third of a step, max error within the clip."""
    qmax = (1 << b.bits) - 1
    blocks = ref.reshape(ref.shape[0], -1, b.block_size)
    rng = np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)
    err = b.dequantize().reshape(blocks.shape) - blocks
    assert (np.abs(err).max(-1) <= 0.2 * rng + 1e-6).all()
    rms = np.sqrt((err ** 2).mean())
    assert rms <= 0.35 * (rng / qmax).mean() + 1e-9
    # The clip search never does worse than plain round-to-nearest over the full range.
    plain = quantize_blocks(ref, b.block_size, b.bits, shrink=(1.0,)).dequantize()
    assert rms <= np.sqrt(((plain - ref) ** 2).mean()) + 1e-9


def test_block_size_other_than_32_requantizes_q4_0():
    t = source(weights(6), 'Q4_0')
    b = to_blocks(t, 64)
    assert b.block_size == 64 and b.packed.shape == (ROWS, COLS // 64, 32)
    _check_requant(b, gguf_dequant(t))


def test_concat_rows_fuses_same_format_and_keeps_mixed_apart():
    a = from_q4_0(source(weights(7), 'Q4_0').data, COLS)
    c = from_q4_1(source(weights(8), 'Q4_1').data, COLS)
    fused = concat_rows([a, c])
    assert len(fused) == 1
    np.testing.assert_array_equal(fused[0].dequantize(),
                                  np.concatenate([a.dequantize(), c.dequantize()]))
    wide = from_q8_0(source(weights(9), 'Q8_0').data, COLS)
    assert len(concat_rows([a, wide])) == 2


def test_unpermute_inverts_llama_cpp_permutation():
    from tiny_model import llama_cpp_permute
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(unpermute_llama_rows(llama_cpp_permute(w, 8), 8), w)


def _session(node, inputs, outputs, inits):
    g = helper.make_graph([node], 'g', inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21),
                                            helper.make_opsetid('com.microsoft', 1)])
    m.ir_version = 10
    return ort.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider'])


@pytest.mark.parametrize('qtype', ['Q4_0', 'Q8_0', 'Q5_0', 'Q3_K', 'Q6_K', 'IQ4_XS'])
def test_matmulnbits_reads_the_packed_layout(qtype):
    t = _random_blocks(qtype, ROWS, COLS, 10) if qtype in EXACT_LAYOUTS else \
        source(weights(10), qtype)
    b = to_blocks(t, 32)
    n, k = b.shape
    node = helper.make_node('MatMulNBits', ['A', 'B', 'S', 'Z'], ['Y'], domain='com.microsoft',
                            K=k, N=n, bits=b.bits, block_size=b.block_size, accuracy_level=0)
    sess = _session(node, [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
                    [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', n])],
                    [numpy_helper.from_array(b.packed, 'B'),
                     numpy_helper.from_array(b.scales, 'S'),
                     numpy_helper.from_array(b.packed_zero_points(), 'Z')])
    a = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {'A': a})[0], a @ b.dequantize().T,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('qtype', ['Q4_0', 'Q8_0'])
@pytest.mark.parametrize('accuracy_level', [0, 4])
def test_default_zero_points_can_be_left_out(qtype, accuracy_level):
    # Q4_0/Q8_0 repacks have MatMulNBits' default zero point 2**(bits-1) everywhere; the graph
    # then leaves the input out, which must give the same results.
    b = to_blocks(source(weights(12), qtype), 32)
    assert b.default_zero_points()
    assert not from_q4_1(source(weights(12), 'Q4_1').data, COLS).default_zero_points()
    n, k = b.shape
    a = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    outs = []
    for inputs in (['A', 'B', 'S', 'Z'], ['A', 'B', 'S']):
        node = helper.make_node('MatMulNBits', inputs, ['Y'], domain='com.microsoft', K=k, N=n,
                                bits=b.bits, block_size=32, accuracy_level=accuracy_level)
        inits = [numpy_helper.from_array(b.packed, 'B'), numpy_helper.from_array(b.scales, 'S')]
        if 'Z' in inputs:
            inits.append(numpy_helper.from_array(b.packed_zero_points(), 'Z'))
        sess = _session(node, [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
                        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', n])], inits)
        outs.append(sess.run(None, {'A': a})[0])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    tol = 0.05 if accuracy_level else 1e-4  # level 4 rounds activations to int8
    np.testing.assert_allclose(outs[1], a @ b.dequantize().T, rtol=tol, atol=tol)


@pytest.mark.parametrize('qtype', ['Q4_0', 'Q4_1', 'Q8_0', 'Q3_K', 'Q6_K'])
def test_gather_block_quantized_reads_the_packed_layout(qtype):
    t = _random_blocks(qtype, ROWS, COLS, 11) if qtype in EXACT_LAYOUTS else \
        source(weights(11), qtype)
    b = to_blocks(t, 32, exact=False)
    n, k = b.shape
    node = helper.make_node('GatherBlockQuantized', ['D', 'I', 'S', 'Z'], ['Y'],
                            domain='com.microsoft', bits=b.bits, block_size=b.block_size,
                            gather_axis=0, quantize_axis=1)
    sess = _session(node, [helper.make_tensor_value_info('I', TensorProto.INT64, ['n'])],
                    [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['n', k])],
                    [numpy_helper.from_array(b.packed.reshape(n, -1), 'D'),
                     numpy_helper.from_array(b.scales, 'S'),
                     numpy_helper.from_array(b.packed_zero_points(), 'Z')])
    ids = np.array([0, 5, 3, n - 1], np.int64)
    np.testing.assert_allclose(sess.run(None, {'I': ids})[0], b.dequantize()[ids],
                               rtol=0, atol=1e-7)
