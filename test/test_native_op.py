"""ONNX Runtime's edge_llm_ros.KQuantMatMul op (native/src/ort_op.cpp) in a real session.

The op multiplies fp32 activations by a weight held in its GGUF blocks. Each output must
equal the scalar reference's dot product of that weight row and that activation row bit for
bit, whatever the batch (a row alone equals the same row among 37, on ORT's intra-op
threads), and the dense float product within quantization error. Bad attributes or shapes
are ORT errors that say what is wrong.
"""
import ctypes

from native_build import native_build
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest
from test_native_ref import K_TYPES, Q8_K_BYTES, random_blocks, TYPES

P = ctypes.c_void_p


def session(type_id: int, weights: np.ndarray, k: int, n: int, threads: int = 2,
            **attributes) -> ort.InferenceSession:
    node = helper.make_node('KQuantMatMul', ['A', 'W'], ['Y'], domain='edge_llm_ros',
                            quant_type=type_id, K=k, N=n, **attributes)
    graph = helper.make_graph(
        [node], 'kquant', [helper.make_tensor_value_info('A', TensorProto.FLOAT, ['M', k])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['M', n])],
        [numpy_helper.from_array(weights, 'W')])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 17),
                                                    helper.make_opsetid('edge_llm_ros', 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_build() / 'libedge_llm_ort_ops.so'))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=['CPUExecutionProvider'])


def reference(elk, type_id: int, weights: np.ndarray, a: np.ndarray) -> np.ndarray:
    k = a.shape[1]
    out = np.zeros((a.shape[0], weights.shape[0]), np.float32)
    for m, row in enumerate(a):
        q = np.zeros(k // 256 * Q8_K_BYTES, np.uint8)
        elk.elk_quantize_row_q8_K_ref(row.ctypes.data_as(P), q.ctypes.data_as(P),
                                      ctypes.c_int64(k))
        for n, w in enumerate(weights):
            value = ctypes.c_float()
            elk.elk_vec_dot_q8_K_ref(type_id, ctypes.c_int64(k), w.ctypes.data_as(P),
                                     q.ctypes.data_as(P), ctypes.byref(value))
            out[m, n] = value.value
    return out


@pytest.fixture(scope='module')
def elk():
    return ctypes.CDLL(str(native_build() / 'libedge_llm_kquant.so'))


@pytest.mark.parametrize('name', K_TYPES)
@pytest.mark.parametrize('k, n', [(256, 8), (768, 37)])
def test_op_equals_the_reference_and_a_row_does_not_depend_on_the_batch(elk, name, k, n):
    type_id = TYPES[name][0]
    rng = np.random.default_rng(k + n + type_id)
    weights = random_blocks(rng, name, n * k // 256).reshape(n, -1)
    a = rng.standard_normal((37, k)).astype(np.float32)
    run = session(type_id, weights, k, n)
    batched = run.run(None, {'A': a})[0]
    assert batched.shape == (37, n)
    assert np.array_equal(batched, reference(elk, type_id, weights, a))
    for m in (0, 5, 36):
        alone = run.run(None, {'A': a[m:m + 1]})[0]
        assert alone.tobytes() == batched[m:m + 1].tobytes()
    # One thread or two: the same bits.
    assert np.array_equal(session(type_id, weights, k, n, threads=1).run(None, {'A': a})[0],
                          batched)
    # Within quantization error of the dense product.
    dense = np.zeros((n, k), np.float32)
    for row in range(n):
        elk.elk_dequantize_row_ref(type_id, weights[row].ctypes.data_as(P),
                                   dense[row].ctypes.data_as(P), ctypes.c_int64(k))
    exact = a.astype(np.float64) @ dense.T.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(dense.T).astype(np.float64)
    assert np.all(np.abs(batched - exact) <= 0.02 * scale)


def quantized(elk, a: np.ndarray) -> np.ndarray:
    k = a.shape[1]
    q = np.zeros((a.shape[0], k // 256 * Q8_K_BYTES), np.uint8)
    for m, row in enumerate(np.ascontiguousarray(a)):
        elk.elk_quantize_row_q8_K_ref(row.ctypes.data_as(P), q[m].ctypes.data_as(P),
                                      ctypes.c_int64(k))
    return q


def reference_gemm(elk, type_id: int, weights: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Return the reference through elk_gemm_q8_K pinned to the scalar kernels (a dot each)."""
    q = quantized(elk, a)
    out = np.full((a.shape[0], weights.shape[0]), np.nan, np.float32)
    assert elk.elk_select_kernel(b'scalar') == 0
    try:
        assert elk.elk_gemm_q8_K(
            type_id, ctypes.c_int64(a.shape[1]), weights.ctypes.data_as(P),
            ctypes.c_size_t(weights.shape[1]), ctypes.c_int64(weights.shape[0]),
            q.ctypes.data_as(P), ctypes.c_size_t(q.shape[1]), ctypes.c_int64(a.shape[0]),
            out.ctypes.data_as(P), ctypes.c_int64(weights.shape[0])) == 0
    finally:
        elk.elk_select_kernel(b'auto')
    return out


@pytest.mark.parametrize('name', K_TYPES)
def test_every_batch_size_to_600_gives_each_row_the_reference_bits(elk, name):
    # N = 99: column tasks of 16 (M <= 4) and 32 with a remainder of 3, so weight tiles of 4
    # and 2 with remainders 3 and 1; M up to 600: activation tiles of 4 with every remainder,
    # and tasks of 64 rows.
    type_id, k, n = TYPES[name][0], 512, 99
    rng = np.random.default_rng(type_id)
    weights = random_blocks(rng, name, n * k // 256).reshape(n, -1)
    a = rng.standard_normal((600, k)).astype(np.float32)
    expected = reference_gemm(elk, type_id, weights, a)
    # The scalar gemm is the reference dot element by element.
    q = quantized(elk, a[[0, 599]])
    for m, row in ((0, 0), (1, 599)):
        for col in (0, 50, 98):
            value = ctypes.c_float()
            elk.elk_vec_dot_q8_K_ref(type_id, ctypes.c_int64(k), weights[col].ctypes.data_as(P),
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
    # The library's own kernels (the tiles this CPU runs) give the same bits through the C API.
    out = np.zeros((600, n), np.float32)
    assert elk.elk_gemm_q8_K(
        type_id, ctypes.c_int64(k), weights.ctypes.data_as(P), ctypes.c_size_t(weights.shape[1]),
        ctypes.c_int64(n), quantized(elk, a).ctypes.data_as(P),
        ctypes.c_size_t(k // 256 * Q8_K_BYTES), ctypes.c_int64(600), out.ctypes.data_as(P),
        ctypes.c_int64(n)) == 0
    assert out.tobytes() == expected.tobytes()


def test_bad_attributes_and_shapes_are_errors_that_say_what_is_wrong():
    weights = np.zeros((8, 144), np.uint8)
    with pytest.raises(Exception, match='quant_type 2 is not Q4_K'):
        session(2, weights, 256, 8).run(None, {'A': np.zeros((1, 256), np.float32)})
    with pytest.raises(Exception, match='not a positive multiple of the block size'):
        session(12, weights, 100, 8).run(None, {'A': np.zeros((1, 100), np.float32)})
    with pytest.raises(Exception, match=r'W is not \[N, row bytes\] = \[9, 144\]'):
        session(12, weights, 256, 9).run(None, {'A': np.zeros((1, 256), np.float32)})
