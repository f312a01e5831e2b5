"""ONNX Runtime's edge_llm_ros.KQuantMatMul and KQuantGather ops (native/src/ort_op.cpp).

KQuantMatMul multiplies fp32 activations by a weight held in its GGUF blocks (any of the 8
types), plus an optional bias. Each output must equal the scalar reference's dot product of
that weight row and that activation row bit for bit, whatever the batch (a row alone equals
the same row among 37, on ORT's intra-op threads, or one session run from several threads),
and the dense float product within quantization error. KQuantGather dequantizes the rows of
such a table bit for bit (the reference and gguf's numpy dequantizer). Bad attributes, shapes
or ids are ORT errors that say what is wrong. With a `glu` attribute the op applies a gated
MLP's activation to its gate|up product (elk_glu, the bits of the plain product's activation).
All in real onnxruntime sessions.
"""
import concurrent.futures
import ctypes
import subprocess

from gguf import GGMLQuantizationType, quants
from native_build import native_build, op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest
from test_native_ref import best_kernel, K_TYPES, Q8_K_BYTES, random_blocks, TYPES

P = ctypes.c_void_p


def session(type_id: int, weights: np.ndarray, k: int, n: int, threads: int = 2,
            bias=None, **attributes) -> ort.InferenceSession:
    """Build a one-node session: Y = KQuantMatMul(A, W[, B]), W (and an array B) initializers.

    bias: None (two inputs), an array (an initializer B) or 'input' (a graph input B of any
    shape, so that the op itself checks it).
    """
    inputs, initializers = [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])], [
        numpy_helper.from_array(weights, 'W')]
    names = ['A', 'W']
    if isinstance(bias, str):
        inputs.append(helper.make_tensor_value_info('B', TensorProto.FLOAT, None))
        names.append('B')
    elif bias is not None:
        initializers.append(numpy_helper.from_array(bias, 'B'))
        names.append('B')
    node = helper.make_node('KQuantMatMul', names, ['Y'], domain='edge_llm_ros',
                            quant_type=type_id, K=k, N=n, **attributes)
    graph = helper.make_graph(
        [node], 'kquant', inputs,
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', None])], initializers)
    return op_session(graph, threads)


# Activation block bytes per weight type: Q8_0 (34 per 32), Q8_1 (36 per 32), Q8_K (292 per 256).
ACTIVATIONS = {'Q4_0': (8, 34), 'Q4_1': (9, 36), 'Q5_0': (8, 34), 'Q5_1': (9, 36),
               'Q8_0': (8, 34), 'Q4_K': (15, Q8_K_BYTES), 'Q5_K': (15, Q8_K_BYTES),
               'Q6_K': (15, Q8_K_BYTES)}


def quantize_activations(elk, name: str, a: np.ndarray) -> np.ndarray:
    """Each row of a in the activation blocks its weight type pairs with (the reference)."""
    activation, size = ACTIVATIONS[name]
    k = a.shape[1]
    out = np.zeros((a.shape[0], k // block(name) * size), np.uint8)
    for m, row in enumerate(np.ascontiguousarray(a, np.float32)):
        assert elk.elk_quantize_row_ref(activation, row.ctypes.data_as(P),
                                        out[m].ctypes.data_as(P), ctypes.c_int64(k)) == 0
    return out


def block(name: str) -> int:
    """Weights per activation block: 32, or 256 for the K types' Q8_K."""
    return 256 if name in K_TYPES else 32


def reference(elk, name: str, weights: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Y[m, n] = elk_vec_dot_ref(W row n, quantized A row m): the scalar reference."""
    type_id, k = TYPES[name][0], a.shape[1]
    q = quantize_activations(elk, name, a)
    out = np.zeros((a.shape[0], weights.shape[0]), np.float32)
    value = ctypes.c_float()
    for n, w in enumerate(weights):
        for m in range(a.shape[0]):
            assert elk.elk_vec_dot_ref(type_id, ctypes.c_int64(k), w.ctypes.data,
                                       q[m].ctypes.data, ctypes.byref(value)) == 0
            out[m, n] = value.value
    return out


def dequantized(elk, name: str, weights: np.ndarray, k: int) -> np.ndarray:
    dense = np.zeros((weights.shape[0], k), np.float32)
    for row in range(weights.shape[0]):
        elk.elk_dequantize_row_ref(TYPES[name][0], weights[row].ctypes.data_as(P),
                                   dense[row].ctypes.data_as(P), ctypes.c_int64(k))
    return dense


def kquant_library() -> ctypes.CDLL:
    """Load libedge_llm_kquant.so with the reference calls' argument types."""
    lib = ctypes.CDLL(str(native_build() / 'libedge_llm_kquant.so'))
    lib.elk_quantize_row_ref.argtypes = [ctypes.c_int, P, P, ctypes.c_int64]
    lib.elk_vec_dot_ref.argtypes = [ctypes.c_int, ctypes.c_int64, P, P,
                                    ctypes.POINTER(ctypes.c_float)]
    lib.elk_glu.argtypes = [ctypes.c_int, P, P, P, ctypes.c_int64]
    return lib


@pytest.fixture(scope='module')
def elk():
    return kquant_library()


@pytest.mark.parametrize('name, k, n', [
    ('Q4_K', 256, 8), ('Q5_K', 768, 37), ('Q6_K', 512, 16),
    ('Q4_0', 96, 7), ('Q4_1', 800, 33), ('Q5_0', 224, 16), ('Q5_1', 32, 1), ('Q8_0', 1120, 9),
])
def test_op_equals_the_reference_and_a_row_does_not_depend_on_the_batch(elk, name, k, n):
    type_id = TYPES[name][0]
    rng = np.random.default_rng(k + n + type_id)
    weights = random_blocks(rng, name, n * k // TYPES[name][2]).reshape(n, -1)
    a = rng.standard_normal((37, k)).astype(np.float32)
    run = session(type_id, weights, k, n)
    batched = run.run(None, {'A': a})[0]
    assert batched.shape == (37, n)
    assert np.array_equal(batched, reference(elk, name, weights, a))
    for m in (0, 5, 36):
        alone = run.run(None, {'A': a[m:m + 1]})[0]
        assert alone.tobytes() == batched[m:m + 1].tobytes()
    # One thread or two: the same bits.
    assert np.array_equal(session(type_id, weights, k, n, threads=1).run(None, {'A': a})[0],
                          batched)
    # Within quantization error of the dense product.
    dense = dequantized(elk, name, weights, k)
    exact = a.astype(np.float64) @ dense.T.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(dense.T).astype(np.float64)
    assert np.all(np.abs(batched - exact) <= 0.02 * scale)


def quantized(elk, name: str, a: np.ndarray) -> np.ndarray:
    """Return the rows of `a` as the activation blocks `name` pairs with (the reference's)."""
    activation, block_bytes = ACTIVATIONS[name]
    k, per = a.shape[1], 256 if activation == 15 else 32
    q = np.zeros((a.shape[0], k // per * block_bytes), np.uint8)
    for m, row in enumerate(np.ascontiguousarray(a)):
        assert elk.elk_quantize_row_ref(activation, row.ctypes.data_as(P),
                                        q[m].ctypes.data_as(P), ctypes.c_int64(k)) == 0
    return q


def gemm(elk, type_id: int, weights: np.ndarray, q: np.ndarray, entry='elk_gemm'):
    """Return every weight row x every activation row through the C entry `entry`."""
    out = np.full((q.shape[0], weights.shape[0]), np.nan, np.float32)
    k = weights.shape[1] // TYPES_BY_ID[type_id][1] * TYPES_BY_ID[type_id][2]
    assert getattr(elk, entry)(
        type_id, ctypes.c_int64(k), weights.ctypes.data_as(P),
        ctypes.c_size_t(weights.shape[1]), ctypes.c_int64(weights.shape[0]),
        q.ctypes.data_as(P), ctypes.c_size_t(q.shape[1]), ctypes.c_int64(q.shape[0]),
        out.ctypes.data_as(P), ctypes.c_int64(weights.shape[0])) == 0
    return out


TYPES_BY_ID = {v[0]: v for v in TYPES.values()}


def reference_gemm(elk, name: str, weights: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Return the reference through elk_gemm pinned to the scalar kernels (a dot each)."""
    q = quantized(elk, name, a)
    assert elk.elk_select_kernel(b'scalar') == 0
    try:
        return gemm(elk, TYPES[name][0], weights, q)
    finally:
        elk.elk_select_kernel(b'auto')


@pytest.mark.parametrize('name', list(TYPES))
def test_every_batch_size_to_600_gives_each_row_the_reference_bits(elk, name):
    # N = 99: column tasks of 16 (M <= 4) and 32 with a remainder of 3, so weight tiles of 4
    # and 2 with remainders 3 and 1; M up to 600: activation tiles of 4 with every remainder,
    # and tasks of 64 rows. Legacy K = 32 x 19: whole steps of 8 blocks and a tail of 3.
    type_id, per = TYPES[name][0], TYPES[name][2]
    k, n = (512 if per == 256 else 32 * 19), 99
    rng = np.random.default_rng(type_id)
    weights = random_blocks(rng, name, n * k // per).reshape(n, -1)
    a = rng.standard_normal((600, k)).astype(np.float32)
    expected = reference_gemm(elk, name, weights, a)
    # The scalar gemm is the reference dot element by element.
    q = quantized(elk, name, a[[0, 599]])
    for m, row in ((0, 0), (1, 599)):
        for col in (0, 50, 98):
            value = ctypes.c_float()
            elk.elk_vec_dot_ref(type_id, ctypes.c_int64(k), weights[col].ctypes.data_as(P),
                                q[m].ctypes.data_as(P), ctypes.byref(value))
            assert value.value == expected[row, col] or (np.isnan(value.value) and
                                                         np.isnan(expected[row, col]))
    run = session(type_id, weights, k, n)
    full = run.run(None, {'A': a})[0]
    assert full.tobytes() == expected.tobytes()
    for m in list(range(1, 10)) + [63, 64, 65, 127, 128, 129, 257, 511, 512, 513, 599]:
        start = (m * 37) % (600 - m + 1)
        got = run.run(None, {'A': a[start:start + m]})[0]
        assert got.tobytes() == expected[start:start + m].tobytes(), m
    # The library's own kernels (the tiles this CPU runs) give the same bits through the C API,
    # elk_gemm_q8_K too for the K types (and refuses the others).
    q = quantized(elk, name, a)
    assert gemm(elk, type_id, weights, q).tobytes() == expected.tobytes()
    if name in K_TYPES:
        assert gemm(elk, type_id, weights, q, 'elk_gemm_q8_K').tobytes() == expected.tobytes()
    else:
        out = np.zeros((1, n), np.float32)
        assert elk.elk_gemm_q8_K(
            type_id, ctypes.c_int64(k), weights.ctypes.data_as(P),
            ctypes.c_size_t(weights.shape[1]), ctypes.c_int64(n), q.ctypes.data_as(P),
            ctypes.c_size_t(q.shape[1]), ctypes.c_int64(1), out.ctypes.data_as(P),
            ctypes.c_int64(n)) == -1


def test_bad_attributes_and_shapes_are_errors_that_say_what_is_wrong():
    weights = np.zeros((8, 144), np.uint8)
    with pytest.raises(Exception, match='quant_type 1 is not a GGUF block type'):
        session(1, weights, 256, 8).run(None, {'A': np.zeros((1, 256), np.float32)})
    with pytest.raises(Exception, match="K 100 is not a positive multiple of Q4_K's block "
                                        'size 256: reconvert the model'):
        session(12, weights, 100, 8).run(None, {'A': np.zeros((1, 100), np.float32)})
    with pytest.raises(Exception, match="K 48 is not a positive multiple of Q4_0's block "
                                        'size 32'):
        session(2, np.zeros((8, 36), np.uint8), 48, 8).run(
            None, {'A': np.zeros((1, 48), np.float32)})
    with pytest.raises(Exception, match=r'W is not \[N, row bytes\] = \[9, 144\]'):
        session(12, weights, 256, 9).run(None, {'A': np.zeros((1, 256), np.float32)})


@pytest.mark.parametrize('name', ['Q4_0', 'Q6_K'])
def test_bias_is_added_to_every_row(elk, name):
    type_id, _, per, _ = TYPES[name]
    k, n = 2 * 256, 7
    rng = np.random.default_rng(type_id + 5)
    weights = random_blocks(rng, name, n * k // per).reshape(n, -1)
    a = rng.standard_normal((5, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    plain = session(type_id, weights, k, n).run(None, {'A': a})[0]
    expected = reference(elk, name, weights, a) + bias  # float32 + float32, per element
    assert np.array_equal(plain + bias, expected)
    assert np.array_equal(session(type_id, weights, k, n, bias=bias).run(None, {'A': a})[0],
                          expected)
    fed = session(type_id, weights, k, n, bias='input')
    assert np.array_equal(fed.run(None, {'A': a, 'B': bias})[0], expected)
    for bad in (bias[:-1], np.zeros((1, n), np.float32), np.zeros(n + 1, np.float32)):
        with pytest.raises(Exception, match=r'bias is not \[N\] = \[7\]'):
            fed.run(None, {'A': a, 'B': bad})


GLU_KINDS = {'silu': 1, 'gelu_tanh': 2}


def glu(elk, kind: str, product: np.ndarray) -> np.ndarray:
    """elk_glu over each row of a [M, 2H] gate|up product: [M, H]."""
    product = np.ascontiguousarray(product, np.float32)
    half = product.shape[1] // 2
    out = np.zeros((product.shape[0], half), np.float32)
    for m, row in enumerate(product):
        assert elk.elk_glu(GLU_KINDS[kind], row.ctypes.data_as(P), row[half:].ctypes.data_as(P),
                           out[m].ctypes.data_as(P), ctypes.c_int64(half)) == 0
    return out


@pytest.mark.parametrize('name, k, n, kind, with_bias', [
    ('Q4_K', 512, 2 * 37, 'silu', False), ('Q6_K', 256, 2 * 64, 'gelu_tanh', True),
    ('Q8_0', 96, 2 * 9, 'silu', True), ('Q4_1', 64, 2 * 70, 'gelu_tanh', False),
])
def test_a_glu_is_the_activation_of_the_plain_product_and_a_row_does_not_depend_on_the_batch(
        elk, name, k, n, kind, with_bias):
    type_id = TYPES[name][0]
    rng = np.random.default_rng(k + n)
    weights = random_blocks(rng, name, n * k // TYPES[name][2]).reshape(n, -1)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    a = (rng.standard_normal((70, k)) * 3).astype(np.float32)
    product = session(type_id, weights, k, n, bias=bias).run(None, {'A': a})[0]
    fused = session(type_id, weights, k, n, bias=bias, glu=kind)
    batched = fused.run(None, {'A': a})[0]
    assert batched.shape == (70, n // 2)
    assert np.array_equal(batched, glu(elk, kind, product))
    for m in (0, 3, 69):  # a GEMV task's columns are not a batch task's: the same bits
        alone = fused.run(None, {'A': a[m:m + 1]})[0]
        assert alone.tobytes() == batched[m:m + 1].tobytes()
    # The activation itself, in float64, times up.
    g, u = product[:, :n // 2], product[:, n // 2:]
    assert np.all(np.abs(batched - activation(kind, g) * u)
                  <= RTOL[kind] * np.abs(activation(kind, g) * u) + 1e-30)


# float32's error in glu's exp argument z grows the result's relative error with |z|: about
# 1e-5 at z = -70 for GELU (float64's own 1 + tanh(u) is worse: it cancels to 0 below u = -19).
RTOL = {'silu': 5e-7, 'gelu_tanh': 2e-5}


def activation(kind: str, gate: np.ndarray) -> np.ndarray:
    """Return SiLU or GELU's tanh form in float64, as g / (1 + exp(-z)) (no cancellation)."""
    g = gate.astype(np.float64)
    z = g if kind == 'silu' else 2 * np.sqrt(2 / np.pi) * g * (1 + 0.044715 * g * g)
    return g / (1 + np.exp(np.minimum(-z, 700)))


def test_elk_glu_is_accurate_over_the_float_range(elk):
    """Check gate values from -100 to 100 in steps of 1e-4, and the exp's range edges.

    Each is within RTOL of float64; results below 1e-30 (exp past float's range) stay below it.
    """
    gate = np.concatenate([np.linspace(-100, 100, 2_000_001),
                           [0.0, -0.0, 87.3, -87.3, 88.3, -88.3, 1e-30, 1e30, -1e30]])
    gate = gate.astype(np.float32)
    for kind in GLU_KINDS:
        got = glu(elk, kind, np.concatenate([gate, np.ones_like(gate)])[None, :])[0]
        want = activation(kind, gate)
        small = np.abs(want) <= 1e-30
        assert np.all(np.abs(got - want)[~small] <= RTOL[kind] * np.abs(want[~small])), kind
        assert np.all(np.abs(got[small]) <= 1e-30), kind
    nan = glu(elk, 'silu', np.array([[np.nan, 1.0]], np.float32))
    assert np.isnan(nan).all()  # a NaN gate stays visible


def test_bad_glu_attributes_are_errors_that_say_what_is_wrong():
    weights = np.zeros((8, 144), np.uint8)
    with pytest.raises(Exception, match='glu "relu" is not "silu", "gelu_tanh" or empty'):
        session(12, weights, 256, 8, glu='relu').run(None, {'A': np.zeros((1, 256), np.float32)})
    with pytest.raises(Exception, match='a glu needs gate rows then as many up rows, but N 7'):
        session(12, weights[:7], 256, 7, glu='silu').run(
            None, {'A': np.zeros((1, 256), np.float32)})


def test_one_session_run_from_several_threads_at_once_gives_each_its_own_result():
    """The activation scratch is per Compute call: concurrent runs do not share it."""
    name, k, n = 'Q8_0', 1024, 16
    type_id = TYPES[name][0]
    rng = np.random.default_rng(3)
    weights = random_blocks(rng, name, n * k // 32).reshape(n, -1)
    run = session(type_id, weights, k, n, threads=1)
    inputs = [rng.standard_normal((int(rng.integers(1, 200)), k)).astype(np.float32)
              for _ in range(8)]
    expected = [run.run(None, {'A': a})[0] for a in inputs]

    def worker(index: int) -> bool:
        return all(np.array_equal(run.run(None, {'A': inputs[(index + i) % 8]})[0],
                                  expected[(index + i) % 8]) for i in range(24))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))


def gather_session(type_id: int, weights: np.ndarray, k: int, tied_n: int = 0,
                   **attributes) -> ort.InferenceSession:
    """E = KQuantGather(W, ids); with tied_n, also Y = KQuantMatMul(E, W) from the same W."""
    nodes = [helper.make_node('KQuantGather', ['W', 'ids'], ['E'], domain='edge_llm_ros',
                              quant_type=type_id, K=k, **attributes)]
    outputs = [helper.make_tensor_value_info('E', TensorProto.FLOAT, None)]
    if tied_n:
        nodes.append(helper.make_node('KQuantMatMul', ['E', 'W'], ['Y'], domain='edge_llm_ros',
                                      quant_type=type_id, K=k, N=tied_n))
        outputs.append(helper.make_tensor_value_info('Y', TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, 'kquant_gather', [helper.make_tensor_value_info('ids', TensorProto.INT64, None)],
        outputs, [numpy_helper.from_array(weights, 'W')])
    return op_session(graph, 2)


@pytest.mark.parametrize('name', sorted(TYPES))
def test_gather_dequantizes_the_rows_bit_for_bit(elk, name):
    type_id, _, per, _ = TYPES[name]
    k = per * (3 if name in K_TYPES else 5)
    v = 11
    rng = np.random.default_rng(type_id + 40)
    weights = random_blocks(rng, name, v * k // per).reshape(v, -1)
    run = gather_session(type_id, weights, k)
    ids = np.array([[3, 0, 10], [3, 7, 1]], np.int64)  # a repeat, the first and last rows
    out = run.run(None, {'ids': ids})[0]
    assert out.shape == (2, 3, k) and out.dtype == np.float32
    dense = dequantized(elk, name, weights, k)
    assert out.reshape(-1, k).tobytes() == dense[ids.reshape(-1)].tobytes()
    gguf_rows = quants.dequantize(weights, GGMLQuantizationType[name]).astype(np.float32)
    assert gguf_rows.shape == (v, k)
    assert np.array_equal(out, gguf_rows[ids])
    # Any id shape: a scalar, a vector, none at all.
    assert run.run(None, {'ids': np.array(4, np.int64)})[0].tobytes() == dense[4].tobytes()
    assert run.run(None, {'ids': np.arange(v, dtype=np.int64)})[0].tobytes() == dense.tobytes()
    assert run.run(None, {'ids': np.zeros((2, 0), np.int64)})[0].shape == (2, 0, k)


def test_gather_refuses_an_id_outside_the_table_and_bad_attributes():
    weights = random_blocks(np.random.default_rng(1), 'Q8_0', 5 * 2).reshape(5, -1)
    run = gather_session(8, weights, 64)
    for bad in (5, -1, 1 << 40):
        with pytest.raises(Exception, match=rf'id {bad} is outside \[0, V\) = \[0, 5\)'):
            run.run(None, {'ids': np.array([0, bad, 1], np.int64)})
    with pytest.raises(Exception, match='KQuantGather: K 48 is not a positive multiple of '
                                        "Q8_0's block size 32"):
        gather_session(8, weights, 48)
    with pytest.raises(Exception, match=r'KQuantGather: W is not \[V, row bytes\] = \[V, 102\]'):
        gather_session(8, weights, 96).run(None, {'ids': np.array([0], np.int64)})


def test_a_tied_embedding_and_lm_head_read_one_table(elk):
    """Token embeddings (KQuantGather) and logits (KQuantMatMul) from the same W initializer."""
    name, k, v = 'Q6_K', 512, 9
    type_id = TYPES[name][0]
    weights = random_blocks(np.random.default_rng(8), name, v * k // 256).reshape(v, -1)
    ids = np.array([[2, 8, 2, 0]], np.int64)
    embeddings, logits = gather_session(type_id, weights, k, tied_n=v).run(None, {'ids': ids})
    dense = dequantized(elk, name, weights, k)
    assert embeddings.tobytes() == dense[ids[0]][None].tobytes()
    assert logits.shape == (1, 4, v)
    assert np.array_equal(logits[0], reference(elk, name, weights, dense[ids[0]]))


def op_library() -> ctypes.CDLL:
    """Load the op library ORT loads, by its path: the same handle, the same kernel choice."""
    lib = ctypes.CDLL(str(native_build() / 'libedge_llm_ort_ops.so'))
    lib.elk_kernel_name.restype = ctypes.c_char_p
    lib.elk_cpu_features.restype = ctypes.c_char_p
    lib.elk_select_kernel.argtypes = [ctypes.c_char_p]
    return lib


def test_the_op_librarys_kernels_are_pinned_and_read_through_ctypes(elk):
    ops = op_library()
    elk.elk_kernel_name.restype = ctypes.c_char_p
    assert ops.elk_select_kernel(b'auto') == 0
    auto = ops.elk_kernel_name()
    assert auto.decode() == best_kernel(ops.elk_cpu_features().decode().split())
    name, k, n = 'Q4_K', 512, 5
    weights = random_blocks(np.random.default_rng(2), name, n * k // 256).reshape(n, -1)
    a = np.random.default_rng(3).standard_normal((3, k)).astype(np.float32)
    try:
        assert ops.elk_select_kernel(b'scalar') == 0
        run = session(TYPES[name][0], weights, k, n)  # ORT loads the library: the pin holds
        assert np.array_equal(run.run(None, {'A': a})[0], reference(elk, name, weights, a))
        assert ops.elk_kernel_name() == b'scalar'
        # The plain C library is another copy with its own choice.
        assert elk.elk_kernel_name() == auto
        assert ops.elk_select_kernel(b'no_such_isa') == -1
        assert ops.elk_kernel_name() == b'scalar'
    finally:
        ops.elk_select_kernel(b'auto')
    assert ops.elk_kernel_name() == auto


def test_each_library_binds_its_calls_to_its_own_kernels():
    """Leave no elk_ symbol to the dynamic linker (-Bsymbolic), and export the kernel API.

    So a library loaded RTLD_GLOBAL first cannot take over the op library's calls (and so
    its pin).
    """
    for library in ('libedge_llm_ort_ops.so', 'libedge_llm_kquant.so'):
        path = str(native_build() / library)
        exported = subprocess.run(['nm', '-D', '--defined-only', path], check=True,
                                  capture_output=True, text=True).stdout.split()
        assert {'elk_kernel_name', 'elk_cpu_features', 'elk_select_kernel',
                'elk_vec_dot'} <= set(exported), library
        relocations = subprocess.run(['readelf', '-rW', path], check=True,
                                     capture_output=True, text=True).stdout
        assert ' elk_' not in relocations, library
