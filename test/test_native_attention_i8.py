"""CausalAttention over int8 KV buffers (kv.dtype int8, issue 39).

The op takes int8 past key/value buffers with their per-row float32 scales (inputs 11, 12;
outputs 3, 4), writes the new rows quantized, and reads the int8 directly: exact integer
dots q8 . k8 (AVX-512 VNNI, AVX2, NEON dotprod or scalar: native/tests/attention_check
compares every path with the scalar one bit for bit). Here the op itself: tiled blocks with
this CPU's dots give the scalar-pinned per-query reference's bits; a position's output does not
depend on its call (one prefill, chunks, decode steps); the stored rows are the float op's rows
quantized as kv_cache.quantize_int8 quantizes a snapshot (so a snapshot is a plain copy); and
the result is float64 attention over the quantized operands (rtol 1e-4), and within a stated
bound of float64 attention over the unquantized ones.
"""
from native_build import op_session
import numpy as np
from onnx import helper, TensorProto
import pytest
from test_native_attention import CALLS, op_library, run as run_float, session as float_session

from edge_llm_ros.runtime.kv_cache import dequantize_int8, quantize_int8

F, I8, I32 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT32


def session(heads: int, kv_heads: int, d: int, cap: int, window: int, threads: int,
            key_type: int = I8, value_type: int = I8):
    """One CausalAttention node over int8 KV buffers and their scales, in the rows form."""
    attrs = {'num_heads': heads, 'kv_num_heads': kv_heads, 'scale': float(d) ** -0.5,
             'window': window}
    names = ['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin', '', 'rows', 'pks', 'pvs']
    kv, scale = ['n', kv_heads, cap, d], ['n', kv_heads, cap, 1]
    shapes = {'q': [1, 't', heads * d], 'k': [1, 't', kv_heads * d],
              'v': [1, 't', kv_heads * d], 'pk': kv, 'pv': kv, 'cos': [cap, d // 2],
              'sin': [cap, d // 2], 'rows': ['r', 4], 'pks': scale, 'pvs': scale}
    types = {'rows': I32, 'pk': key_type, 'pv': value_type}
    node = helper.make_node('CausalAttention', names, ['o', 'ok', 'ov', 'oks', 'ovs'],
                            domain='edge_llm_ros', **attrs)
    graph = helper.make_graph(
        [node], 'attention_i8',
        [helper.make_tensor_value_info(n, types.get(n, F), shapes[n]) for n in names if n],
        [helper.make_tensor_value_info('o', F, [1, 't', heads * d]),
         helper.make_tensor_value_info('ok', key_type, kv),
         helper.make_tensor_value_info('ov', value_type, kv),
         helper.make_tensor_value_info('oks', F, scale),
         helper.make_tensor_value_info('ovs', F, scale)])
    return op_session(graph, threads)


def run(sess, feeds, buffers) -> np.ndarray:
    """Run with the int8 buffers and scales bound as past and present (updated in place)."""
    import onnxruntime as ort
    io = sess.io_binding()
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    io.bind_output('o')
    for past, present, array in zip(('pk', 'pv', 'pks', 'pvs'), ('ok', 'ov', 'oks', 'ovs'),
                                    buffers):
        value = ort.OrtValue.ortvalue_from_numpy(array)
        io.bind_ortvalue_input(past, value)
        io.bind_ortvalue_output(present, value)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def rope(cap: int, d: int):
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def int8_buffers(keys: np.ndarray, values: np.ndarray):
    """Return [keys q8, values q8, key scales, value scales] (kv_cache's snapshot format)."""
    (kq, ks), (vq, vs) = quantize_int8(keys), quantize_int8(values)
    return [kq, vq, ks, vs]


@pytest.mark.parametrize('shape', [(12, 2, 128, 1100, 0), (9, 3, 64, 1100, 0),
                                   (8, 2, 80, 1100, 300), (4, 4, 6, 1100, 0)],
                         ids=['group6-d128', 'group3-d64', 'window300-d80', 'mha-d6'])
@pytest.mark.parametrize('threads', [1, 2])
def test_the_int8_op_gives_the_scalar_references_bits(shape, threads):
    heads, kv_heads, d, cap, window = shape
    rng = np.random.default_rng(d + heads + threads)
    cos, sin = rope(cap, d)
    ops = op_library()
    tiled = session(heads, kv_heads, d, cap, window, threads)
    reference = session(heads, kv_heads, d, cap, window, threads)
    # Garbage past every slot's positions: no query may read it.
    got_buffers = int8_buffers(rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32),
                               rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32))
    want_buffers = [b.copy() for b in got_buffers]
    for rows in CALLS:
        t = sum(r[2] for r in rows)
        feeds = {'q': rng.standard_normal((1, t, heads * d)).astype(np.float32) * 2,
                 'k': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32) * 2,
                 'v': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32),
                 'cos': cos, 'sin': sin, 'rows': np.array(rows, np.int32)}
        assert ops.elk_select_kernel(b'auto') == 0
        got = run(tiled, feeds, got_buffers)
        try:
            assert ops.elk_select_kernel(b'scalar') == 0
            want = run(reference, feeds, want_buffers)
        finally:
            ops.elk_select_kernel(b'auto')
        assert got.tobytes() == want.tobytes(), rows
        for a, b in zip(got_buffers, want_buffers):
            assert a.tobytes() == b.tobytes()


def test_a_positions_output_does_not_depend_on_its_call():
    """One 200-position prefill, the same in chunks of 64 / 100 / 36, then decode steps."""
    heads, kv_heads, d, cap, t = 6, 2, 64, 256, 200
    rng = np.random.default_rng(11)
    cos, sin = rope(cap, d)
    q = rng.standard_normal((1, t, heads * d)).astype(np.float32)
    k = rng.standard_normal((1, t, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((1, t, kv_heads * d)).astype(np.float32)
    sess = session(heads, kv_heads, d, cap, 0, 2)

    def fresh():
        return [np.zeros((1, kv_heads, cap, d), np.int8), np.zeros((1, kv_heads, cap, d), np.int8),
                np.zeros((1, kv_heads, cap, 1), np.float32),
                np.zeros((1, kv_heads, cap, 1), np.float32)]

    def calls(bounds):
        buffers, outs = fresh(), []
        for a, b in zip(bounds, bounds[1:]):
            feeds = {'q': q[:, a:b], 'k': k[:, a:b], 'v': v[:, a:b], 'cos': cos, 'sin': sin,
                     'rows': np.array([(0, a, b - a, 0)], np.int32)}
            outs.append(run(sess, feeds, buffers))
        return np.concatenate(outs, 1), buffers
    whole, buffers = calls([0, t])
    chunked, chunk_buffers = calls([0, 64, 164, 196, 197, 198, 199, 200])
    assert whole.tobytes() == chunked.tobytes()
    for a, b in zip(buffers, chunk_buffers):
        assert a.tobytes() == b.tobytes()


def test_the_stored_rows_are_the_float_rows_quantized_as_a_snapshot():
    """The int8 op's buffers equal quantize_int8 of the float op's buffers, bit for bit."""
    heads, kv_heads, d, cap, t = 4, 2, 64, 128, 100
    rng = np.random.default_rng(5)
    cos, sin = rope(cap, d)
    feeds = {'q': rng.standard_normal((1, t, heads * d)).astype(np.float32),
             'k': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32) * 3,
             'v': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32),
             'cos': cos, 'sin': sin, 'rows': np.array([(0, 0, t, 0)], np.int32)}
    keys = np.zeros((1, kv_heads, cap, d), np.float32)
    values = np.zeros_like(keys)
    run_float(float_session(heads, kv_heads, d, cap, 0, False, 1), feeds, keys, values)
    buffers = [np.zeros((1, kv_heads, cap, d), np.int8), np.zeros((1, kv_heads, cap, d), np.int8),
               np.zeros((1, kv_heads, cap, 1), np.float32),
               np.zeros((1, kv_heads, cap, 1), np.float32)]
    run(session(heads, kv_heads, d, cap, 0, 1), feeds, buffers)
    want = int8_buffers(keys, values)
    for got, expected in zip(buffers, want):
        assert got.tobytes() == expected.tobytes()


def test_the_int8_op_equals_float64_attention_over_its_quantized_operands():
    """Match float64 over the quantized operands (rtol 1e-4), and the exact inputs closely.

    Over q8, K8, V8 and their scales only float32 rounding differs; against float64 over the
    unquantized inputs the error stays below 3 % of the values' spread (int8 rows: about
    0.4 % of a row's max per value).
    """
    heads, kv_heads, d, cap, t = 4, 2, 64, 400, 300
    rng = np.random.default_rng(3)
    cos, sin = rope(cap, d)
    q = rng.standard_normal((t, heads, d)) * 2
    k = rng.standard_normal((t, kv_heads, d)) * 2
    v = rng.standard_normal((t, kv_heads, d))
    feeds = {'q': q.reshape(1, t, -1).astype(np.float32),
             'k': k.reshape(1, t, -1).astype(np.float32),
             'v': v.reshape(1, t, -1).astype(np.float32), 'cos': cos, 'sin': sin,
             'rows': np.array([(0, 0, t, 0)], np.int32)}
    buffers = [np.zeros((1, kv_heads, cap, d), np.int8), np.zeros((1, kv_heads, cap, d), np.int8),
               np.zeros((1, kv_heads, cap, 1), np.float32),
               np.zeros((1, kv_heads, cap, 1), np.float32)]
    got = run(session(heads, kv_heads, d, cap, 0, 1), feeds, buffers).reshape(t, heads, d)
    half = d // 2

    def rotate(x):
        c, s = cos[:t, None, :], sin[:t, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def attention(qr, kr, vv):
        group = heads // kv_heads
        out = np.empty((t, heads, d))
        for h in range(heads):
            scores = qr[:, h] @ kr[:, h // group].T / np.sqrt(d)
            scores += np.triu(np.full((t, t), -np.inf), 1)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, h] = (p / p.sum(-1, keepdims=True)) @ vv[:, h // group]
        return out
    qr = rotate(feeds['q'].reshape(t, heads, d))   # float32, as the op rotates
    q8, qs = quantize_int8(qr)
    kr = dequantize_int8(buffers[0], buffers[2])[0, :, :t].transpose(1, 0, 2)
    vr = dequantize_int8(buffers[1], buffers[3])[0, :, :t].transpose(1, 0, 2)
    quantized = attention(q8.astype(np.float64) * qs, kr.astype(np.float64),
                          vr.astype(np.float64))
    np.testing.assert_allclose(got, quantized, rtol=1e-4, atol=1e-5)
    exact = attention(rotate(feeds['q'].reshape(t, heads, d).astype(np.float64)),
                      rotate(feeds['k'].reshape(t, kv_heads, d).astype(np.float64)),
                      feeds['v'].reshape(t, kv_heads, d).astype(np.float64))
    assert np.abs(got - exact).max() < 0.03 * np.ptp(v)


@pytest.mark.parametrize('types', [(I8, F), (F, F)], ids=['mixed', 'float-with-scales'])
def test_mixed_buffers_or_scales_beside_float_buffers_are_refused(types):
    heads, kv_heads, d, cap = 2, 1, 8, 16
    sess = session(heads, kv_heads, d, cap, 0, 1, *types)
    cos, sin = rope(cap, d)
    feeds = {'q': np.zeros((1, 1, heads * d), np.float32),
             'k': np.zeros((1, 1, kv_heads * d), np.float32),
             'v': np.zeros((1, 1, kv_heads * d), np.float32), 'cos': cos, 'sin': sin,
             'rows': np.array([(0, 0, 1, 0)], np.int32)}
    kinds = {I8: np.int8, F: np.float32}
    buffers = [np.zeros((1, kv_heads, cap, d), kinds[t]) for t in types] + \
        [np.zeros((1, kv_heads, cap, 1), np.float32) for _ in range(2)]
    message = 'must both be float32 or both int8' if types[0] != types[1] else 'take no scales'
    with pytest.raises(Exception, match=message):
        run(sess, feeds, buffers)
