"""KQuantMatMul on every kernel path this CPU runs, for all 8 GGUF types, in real sessions.

Each kernel set the op library can run here (scalar, avx2, avx512_vnni, amx on x86-64; neon,
neon_dotprod, neon_i8mm on aarch64) is pinned in turn through ctypes on the very library ONNX
Runtime loaded. For each: the op's output equals the scalar reference bit for bit, and a row
computed alone equals the same row in the batch. Odd shapes: K = 32 x an odd block count for
the legacy types, N of 1, 7, 33 (not a multiple of the 16-column tasks), M of 1, 2, 37 and 600
(AMX's 16-row tiles: whole, partial and in pairs).

Against others: ggml's own dot products (its SIMD build, on its own activation blocks, which
equal ours byte for byte) within DOT_RTOL of the magnitude sum |w| |a|, as the two sum in
other orders; and gguf's numpy dequantizer times the fp32 activations within the activation
quantization error, bounded per element from each activation block's step d = amax / 127:
|a - q d16| <= d / 2 + 127 |d - d16| <= 0.6 d (Q8_0/Q8_1 store d in fp16, Q8_K in fp32), so
|Y - A W^T| <= 0.6 sum_k |w_k| d(k) (+ for Q4_1/Q5_1 the fp16 s = d * sum q: |m| d 32 127 /
1024 per block) + 1e-5 sum |w| |a| for float rounding.
"""
import ctypes

from gguf import GGMLQuantizationType, quants
import numpy as np
import pytest
from test_native_op import (ACTIVATIONS, block, dequantized, kquant_library, op_library,
                            quantize_activations, reference, session)
import test_native_ref
from test_native_ref import DOT_RTOL, random_blocks, TYPES

P = ctypes.c_void_p
ggml = test_native_ref.ggml  # the fixture loading ggml's own libraries
ISAS = (b'scalar', b'avx2', b'avx512_vnni', b'amx', b'neon', b'neon_dotprod', b'neon_i8mm')
# name: (K, N, M), K in odd block counts for the legacy types (41 = 5 steps of 8 + 1).
SHAPES = {
    'Q4_0': (32 * 7, 33, 37), 'Q4_1': (32 * 25, 7, 2), 'Q5_0': (32 * 9, 1, 600),
    'Q5_1': (32 * 3, 16, 1), 'Q8_0': (32 * 41, 9, 37), 'Q4_K': (256 * 3, 7, 600),
    'Q5_K': (512, 33, 37), 'Q6_K': (256, 1, 37),
}


@pytest.fixture(scope='module')
def elk():
    return kquant_library()


@pytest.fixture(scope='module')
def ops():
    lib = op_library()
    yield lib
    lib.elk_select_kernel(b'auto')


def kernels(ops) -> list:
    """Return the kernel sets this CPU runs (an ISA it lacks is refused by the pin)."""
    usable = [isa for isa in ISAS if ops.elk_select_kernel(isa) == 0]
    features = ops.elk_cpu_features().split()
    assert b'scalar' in usable
    assert (b'avx2' in usable) == (b'avx2' in features)
    assert (b'avx512_vnni' in usable) == (b'avx512vnni' in features)
    assert (b'amx' in usable) == (b'amx_int8' in features)
    assert (b'neon_dotprod' in usable) == (b'dotprod' in features)
    assert (b'neon_i8mm' in usable) == (b'i8mm' in features)
    return usable


def operands(name: str, k: int, n: int, m: int, seed: int = 0):
    type_id, _, per, _ = TYPES[name]
    rng = np.random.default_rng(type_id * 1000 + k + n + m + seed)
    weights = random_blocks(rng, name, n * k // per).reshape(n, -1)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[0, :32] = 0.0  # an all-zero activation block (scale 0)
    return weights, a


@pytest.mark.parametrize('name', sorted(TYPES))
def test_every_kernel_gives_the_references_bits_and_rows_do_not_depend_on_the_batch(
        elk, ops, name):
    k, n, m = SHAPES[name]
    weights, a = operands(name, k, n, m)
    expected = reference(elk, name, weights, a)
    run = session(TYPES[name][0], weights, k, n)
    ran = []
    for isa in kernels(ops):
        assert ops.elk_select_kernel(isa) == 0
        batched = run.run(None, {'A': a})[0]
        assert batched.shape == (m, n)
        assert batched.tobytes() == expected.tobytes(), isa
        for row in sorted({0, m // 2, m - 1}):
            alone = run.run(None, {'A': a[row:row + 1]})[0]
            assert alone.tobytes() == batched[row:row + 1].tobytes(), (isa, row)
        if m > 1:
            pair = run.run(None, {'A': a[m - 2:]})[0]
            assert pair.tobytes() == batched[m - 2:].tobytes(), isa
        ran.append(ops.elk_kernel_name())
    assert ran == kernels(ops)  # the pin is what the op library reports
    ops.elk_select_kernel(b'auto')


def ggml_activations(base, name: str, a: np.ndarray) -> np.ndarray:
    activation, size = ACTIVATIONS[name]
    fn = getattr(base, {8: 'quantize_row_q8_0_ref', 9: 'quantize_row_q8_1_ref',
                        15: 'quantize_row_q8_K_ref'}[activation])
    out = np.zeros((a.shape[0], a.shape[1] // block(name) * size), np.uint8)
    for row in range(a.shape[0]):
        fn(a[row].ctypes.data_as(P), out[row].ctypes.data_as(P), ctypes.c_int64(a.shape[1]))
    return out


def ggml_vec_dot(cpu, name: str):
    activation = {8: 'q8_0', 9: 'q8_1', 15: 'q8_K'}[ACTIVATIONS[name][0]]
    fn = getattr(cpu, f'ggml_vec_dot_{name[:-1].lower()}{name[-1]}_{activation}')
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, P,
                   ctypes.c_size_t, P, ctypes.c_size_t, ctypes.c_int]
    return fn


@pytest.mark.parametrize('name', sorted(TYPES))
def test_every_kernel_agrees_with_ggml_and_with_ggufs_dequantizer(elk, ops, ggml, name):
    base, cpu = ggml
    k, n = SHAPES[name][0], 7
    weights, a = operands(name, k, n, 5, seed=1)
    # ggml's activation blocks are ours, byte for byte: the same operands for both dots.
    theirs_q = ggml_activations(base, name, a)
    assert np.array_equal(theirs_q, quantize_activations(elk, name, a))
    dot = ggml_vec_dot(cpu, name)
    theirs = np.zeros((a.shape[0], n), np.float32)
    value = ctypes.c_float()
    for col in range(n):
        for row in range(a.shape[0]):
            dot(k, ctypes.byref(value), 0, weights[col].ctypes.data_as(P), 0,
                theirs_q[row].ctypes.data_as(P), 0, 1)
            theirs[row, col] = value.value
    dense = quants.dequantize(weights, GGMLQuantizationType[name]).astype(np.float64)
    assert np.array_equal(dense, dequantized(elk, name, weights, k))
    magnitude = np.abs(a).astype(np.float64) @ np.abs(dense.T)
    bound = quantization_bound(name, weights, dense, a)
    exact = a.astype(np.float64) @ dense.T
    assert np.all(bound <= 0.05 * magnitude + 1e-30)  # the bound says something
    run = session(TYPES[name][0], weights, k, n)
    for isa in kernels(ops):
        assert ops.elk_select_kernel(isa) == 0
        mine = run.run(None, {'A': a})[0]
        assert np.all(np.abs(mine - theirs) <= DOT_RTOL * magnitude), isa
        assert np.all(np.abs(mine - exact) <= bound), isa
    ops.elk_select_kernel(b'auto')


def quantization_bound(name: str, weights: np.ndarray, dense: np.ndarray,
                       a: np.ndarray) -> np.ndarray:
    """Bound |Y - A W^T| per element: the activations' quantization error (module doc)."""
    per = block(name)
    m, k = a.shape
    step = np.abs(a).reshape(m, k // per, per).max(axis=2).astype(np.float64) / 127.0
    error = 0.6 * np.repeat(step, per, axis=1)                  # |a - dequantized a| <= this
    bound = error @ np.abs(dense.T) + 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(dense.T))
    if name in ('Q4_1', 'Q5_1'):
        blocks = weights.reshape(weights.shape[0], k // 32, -1)
        mins = np.abs(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        bound += step @ mins.T * (32 * 127 / 1024)
    return bound
