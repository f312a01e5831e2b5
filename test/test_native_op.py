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


def test_bad_attributes_and_shapes_are_errors_that_say_what_is_wrong():
    weights = np.zeros((8, 144), np.uint8)
    with pytest.raises(Exception, match='quant_type 2 is not Q4_K'):
        session(2, weights, 256, 8).run(None, {'A': np.zeros((1, 256), np.float32)})
    with pytest.raises(Exception, match='not a positive multiple of the block size'):
        session(12, weights, 100, 8).run(None, {'A': np.zeros((1, 100), np.float32)})
    with pytest.raises(Exception, match=r'W is not \[N, row bytes\] = \[9, 144\]'):
        session(12, weights, 256, 9).run(None, {'A': np.zeros((1, 256), np.float32)})
