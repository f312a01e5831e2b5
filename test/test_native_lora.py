"""The op library's LoRA kernels: every ISA path gives the scalar reference's bits.

native/src/lora.cpp (reference), avx2.cpp, avx512.cpp: a row's result does not depend on
the rows beside it, a scale of 0 leaves the row untouched, and the result is B·(A·x) scaled
(float64 to 1e-5). A and B stored as F16 or BF16 (widened as the kernels read them) give the
bits of the same values stored as float32, on every path.
"""
import ctypes

from native_build import native_build, op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import pytest
from test_native_op import glu, kquant_library
from test_native_ref import random_blocks

from edge_llm_ros.runtime.lora_adapter import LoraPair, narrowest_storage

F32P = ctypes.POINTER(ctypes.c_float)


@pytest.fixture(scope='module')
def lib():
    lib = ctypes.CDLL(str(native_build() / 'libedge_llm_kquant.so'))
    lib.elk_lora_apply_typed.argtypes = [F32P, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int, F32P, F32P]
    lib.elk_select_kernel.argtypes = [ctypes.c_char_p]
    lib.elk_kernel_name.restype = ctypes.c_char_p
    yield lib
    lib.elk_select_kernel(b'auto')


def ptr(a: np.ndarray):
    return a.ctypes.data_as(F32P)


def apply(lib, x, a_t, b_t, scales, y):
    y = y.copy()
    a_t = np.ascontiguousarray(a_t, dtype=np.float32)
    b_t = np.ascontiguousarray(b_t, dtype=np.float32)
    rc = lib.elk_lora_apply_typed(ptr(x), x.shape[0], x.shape[1], a_t.ctypes.data, a_t.shape[1],
                                  b_t.ctypes.data, b_t.shape[1], 0, ptr(scales), ptr(y))
    assert rc == 0
    return y


@pytest.mark.parametrize('k, r, n', [(64, 16, 96), (576, 16, 1536), (100, 7, 33), (32, 1, 5)])
def test_isa_paths_equal_the_reference(lib, k, r, n):
    rng = np.random.default_rng(k + r + n)
    rows = 5
    x = rng.normal(size=(rows, k)).astype(np.float32)
    a_t = rng.normal(0, 0.1, (k, r)).astype(np.float32)
    b_t = rng.normal(0, 0.1, (r, n)).astype(np.float32)
    y = rng.normal(size=(rows, n)).astype(np.float32)
    scales = np.array([0.5, 0.0, 2.0, -1.0, 1.0], dtype=np.float32)
    results = {}
    for isa in ('scalar', 'avx2', 'avx512_vnni', 'amx'):
        if lib.elk_select_kernel(isa.encode()) == 0:
            results[isa] = apply(lib, x, a_t, b_t, scales, y)
    lib.elk_select_kernel(b'auto')
    ref = results.pop('scalar')
    for isa, out in results.items():
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), isa
    assert np.array_equal(ref[1], y[1])           # scale 0: untouched
    want = y.astype(np.float64) + scales[:, None] * (x @ a_t.astype(np.float64) @ b_t)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    for m in range(rows):                         # a row alone: the same bits
        alone = apply(lib, x[m:m + 1].copy(), a_t, b_t, scales[m:m + 1].copy(),
                      y[m:m + 1].copy())
        assert np.array_equal(alone[0], ref[m])


def apply_typed(lib, x, a_t, b_t, dtype, scales, y):
    y = y.copy()
    rc = lib.elk_lora_apply_typed(ptr(x), x.shape[0], x.shape[1], a_t.ctypes.data, a_t.shape[1],
                                  b_t.ctypes.data, b_t.shape[1], {'f16': 1, 'bf16': 2}[dtype],
                                  ptr(scales), ptr(y))
    assert rc == 0
    return y


@pytest.mark.parametrize('dtype', ['f16', 'bf16'])
@pytest.mark.parametrize('k, r, n', [(576, 16, 1536), (100, 7, 33), (64, 24, 200), (32, 8, 5)])
def test_half_storage_gives_the_float32_bits(lib, dtype, k, r, n):
    rng = np.random.default_rng(7 * k + r + n)
    rows = 4
    x = rng.normal(size=(rows, k)).astype(np.float32)
    a32 = rng.normal(0, 0.1, (k, r)).astype(np.float32)
    b32 = rng.normal(0, 0.1, (r, n)).astype(np.float32)
    if dtype == 'f16':
        a32[0, 0], b32[0, 0] = 3e-7, -5e-8          # F16 subnormals widen exactly too
        a_t, b_t = a32.astype(np.float16), b32.astype(np.float16)
    else:
        a_t, b_t = ((v.view(np.uint32) >> 16).astype(np.uint16) for v in (a32, b32))
    pair = LoraPair(a_t.T, b_t.T, dtype).widened()   # the values the kernels compute with
    a_w, b_w = np.ascontiguousarray(pair.a.T), np.ascontiguousarray(pair.b.T)
    y = rng.normal(size=(rows, n)).astype(np.float32)
    scales = np.array([0.5, 0.0, 2.0, -1.0], dtype=np.float32)
    lib.elk_select_kernel(b'scalar')
    ref = apply(lib, x, a_w, b_w, scales, y)         # float32 storage, the reference
    for isa in ('scalar', 'avx2', 'avx512_vnni', 'amx'):
        if lib.elk_select_kernel(isa.encode()) == 0:
            out = apply_typed(lib, x, a_t, b_t, dtype, scales, y)
            assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), isa
            alone = apply_typed(lib, x[2:3].copy(), a_t, b_t, dtype, scales[2:3].copy(),
                                y[2:3].copy())
            assert np.array_equal(alone[0].view(np.uint32), ref[2].view(np.uint32)), isa
    lib.elk_select_kernel(b'auto')
    assert np.array_equal(ref[1], y[1])


@pytest.mark.parametrize('source', ['F16', 'BF16', 'F32', 'Q8_0'])
def test_pairs_keep_the_narrowest_exact_storage(source):
    """An F16 / BF16 file's values stay 2 bytes; other sources stay float32 (narrowest_storage)."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 0.02, (16, 64)).astype(np.float32), rng.normal(0, 0.02, (96, 16))
    b = b.astype(np.float32)
    if source == 'F16':
        a, b = (v.astype(np.float16).astype(np.float32) for v in (a, b))
    elif source == 'BF16':
        a, b = ((v.view(np.uint32) & 0xFFFF0000).view(np.float32) for v in (a, b))
    elif source == 'Q8_0':   # fp16 scale times int8: more bits than F16 or BF16 keep
        a = (np.float32(0.0123) * rng.integers(-127, 128, a.shape)).astype(np.float32)
    stored = narrowest_storage(LoraPair(a, b))
    assert stored.dtype == {'F16': 'f16', 'BF16': 'bf16'}.get(source, 'f32')
    back = stored.widened()
    assert np.array_equal(back.a.view(np.uint32), a.view(np.uint32))
    assert np.array_equal(back.b.view(np.uint32), b.view(np.uint32))


def op_node_session(weights, k: int, n: int, glu: str = '', threads: int = 2):
    """One KQuantMatMul node named 'lora_node' (where pairs register) over Q8_0 weights."""
    attributes = {'glu': glu} if glu else {}
    node = helper.make_node('KQuantMatMul', ['A', 'W'], ['Y'], name='lora_node',
                            domain='edge_llm_ros', quant_type=8, K=k, N=n, **attributes)
    graph = helper.make_graph(
        [node], 'lora', [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', None])],
        [numpy_helper.from_array(weights, 'W')])
    return op_session(graph, threads)


def set_rows(ops, table):
    """Set the op library's row table: table[m] = [(adapter id, scale), ...]."""
    offsets = np.cumsum([0] + [len(uses) for uses in table]).astype(np.int64)
    ids = np.array([i for uses in table for i, _ in uses] or [0], dtype=np.int64)
    scales = np.array([s for uses in table for _, s in uses] or [0], dtype=np.float32)
    assert ops.elk_lora_set_rows(len(table), offsets.ctypes.data, ids.ctypes.data,
                                 scales.ctypes.data) == 0


@pytest.mark.parametrize('glu', ['', 'silu'])
def test_registered_pairs_off_the_column_blocks_give_the_reference_bits(lib, glu):
    """Pairs whose columns start and end off the op's column blocks and tasks.

    Segments of odd widths at odd columns, two adapters overlapping on a column range: each
    adapted output is the base product plus, per column, a sum from 0 of scale * B(A x) in the
    row table's order (the reference's t per pair from elk_lora_apply_typed), and a row alone
    gives the bits it has in the batch.
    """
    ops = ctypes.CDLL(str(native_build() / 'libedge_llm_ort_ops.so'))
    ops.elk_lora_add_typed.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                       ctypes.c_int]
    ops.elk_lora_remove.restype = ctypes.c_int64
    ops.elk_lora_remove.argtypes = [ctypes.c_int64]
    ops.elk_lora_set_rows.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p]
    rng = np.random.default_rng(43)
    k, r, n_w = 64, 5, 2 * 70   # W rows; with a glu: gate 0..69, up 70..139
    weights = random_blocks(rng, 'Q8_0', n_w * k // 32).reshape(n_w, -1)
    x = rng.normal(size=(5, k)).astype(np.float32)
    # (adapter, col, width): adapter 1 in two segments, adapter 2 across both of them.
    segments = [(1, 3, 21), (1, 24, 101), (2, 17, 57)]
    pairs = []
    for adapter, col, width in segments:
        a_t = rng.normal(0, 0.3, (k, r)).astype(np.float16)
        b_t = rng.normal(0, 0.3, (r, width)).astype(np.float16)
        pairs.append((adapter, col, width, a_t, b_t))
    table = [[(1, 0.5)], [], [(1, 1.0), (2, -2.0)], [(2, 1.5)], [(1, 0.0)]]
    plain = op_node_session(weights, k, n_w)
    set_rows(ops, [])
    base = plain.run(None, {'A': x})[0]
    want = base.copy()
    for m, uses in enumerate(table):
        d = np.zeros(n_w, np.float32)
        used = False
        for adapter, scale in uses:
            if scale == 0.0:
                continue
            for pair_adapter, col, width, a_t, b_t in pairs:
                if pair_adapter != adapter:
                    continue
                t = apply_typed(lib, x[m:m + 1].copy(), a_t, b_t, 'f16',
                                np.ones(1, np.float32), np.zeros((1, width), np.float32))[0]
                d[col:col + width] = d[col:col + width] + np.float32(scale) * t
                used = True
        if used:
            want[m] = want[m] + d
    try:
        for adapter, col, width, a_t, b_t in pairs:
            assert ops.elk_lora_add_typed(b'lora_node', adapter, k, r, a_t.ctypes.data, width,
                                          b_t.ctypes.data, col, 0.0, 1) == 0
        run = op_node_session(weights, k, n_w, glu) if glu else plain
        if glu:
            want = glu_of(want)
        set_rows(ops, table)
        batched = run.run(None, {'A': x})[0]
        assert batched.view(np.uint32).tolist() == want.view(np.uint32).tolist()
        for m in range(len(table)):
            set_rows(ops, [table[m]])
            alone = run.run(None, {'A': x[m:m + 1]})[0]
            assert alone.tobytes() == batched[m:m + 1].tobytes()
    finally:
        set_rows(ops, [])
        ops.elk_lora_remove(1)
        ops.elk_lora_remove(2)


def glu_of(product: np.ndarray) -> np.ndarray:
    """Return elk_glu('silu') of each [gate | up] row."""
    return glu(kquant_library(), 'silu', product)
