"""CausalAttention's tiled blocks give the per-query reference's bits (issue 39).

The op runs a task per (row, KV head, chunk of the group's heads, block of queries) through
elk_attention_block, which reads each tile of keys and values once for the whole block; pinned
to the scalar reference (elk_select_kernel), it runs elk_attention_row one query at a time.
native/tests/attention_check compares the two entries directly on random shapes; here the op
itself, on contexts longer than one tile (300 and 1000 positions), must give the reference's
outputs and KV buffers bit for bit: prefill, a chunk and a bidirectional row mid-buffer, and
decode steps, at 1 and 2 threads.
"""
import ctypes
import subprocess

from native_build import native_build, op_session
import numpy as np
from onnx import helper, TensorProto
import pytest

F, I32 = TensorProto.FLOAT, TensorProto.INT32


def test_attention_block_equals_attention_row_bit_for_bit():
    proc = subprocess.run([str(native_build() / 'attention_check')], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'ok attention_block' in proc.stdout


def session(heads: int, kv_heads: int, d: int, cap: int, window: int, norms: bool,
            threads: int):
    """One CausalAttention node in the rows form, KV buffers bound in place."""
    attrs = {'num_heads': heads, 'kv_num_heads': kv_heads, 'scale': float(d) ** -0.5,
             'window': window}
    if norms:
        rng = np.random.default_rng(7)
        attrs.update(q_norm=list(rng.uniform(0.5, 1.5, d).astype(np.float32)),
                     k_norm=list(rng.uniform(0.5, 1.5, d).astype(np.float32)),
                     norm_epsilon=1e-6)
    names = ['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin', '', 'rows']
    shapes = {'q': [1, 't', heads * d], 'k': [1, 't', kv_heads * d],
              'v': [1, 't', kv_heads * d], 'pk': ['n', kv_heads, cap, d],
              'pv': ['n', kv_heads, cap, d], 'cos': [cap, d // 2], 'sin': [cap, d // 2],
              'rows': ['r', 4]}
    node = helper.make_node('CausalAttention', names, ['o', 'ok', 'ov'],
                            domain='edge_llm_ros', **attrs)
    graph = helper.make_graph(
        [node], 'attention',
        [helper.make_tensor_value_info(n, I32 if n == 'rows' else F, shapes[n])
         for n in names if n],
        [helper.make_tensor_value_info('o', F, [1, 't', heads * d]),
         helper.make_tensor_value_info('ok', F, ['n', kv_heads, cap, d]),
         helper.make_tensor_value_info('ov', F, ['n', kv_heads, cap, d])])
    return op_session(graph, threads)


def run(sess, feeds, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Run with the KV buffers bound as past and present (updated in place, as the engine)."""
    import onnxruntime as ort
    io = sess.io_binding()
    k, v = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    io.bind_ortvalue_input('pk', k)
    io.bind_ortvalue_input('pv', v)
    io.bind_output('o')
    io.bind_ortvalue_output('ok', k)
    io.bind_ortvalue_output('ov', v)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def op_library() -> ctypes.CDLL:
    """Load the op library ORT loads, by its path: the same handle, the same kernel choice."""
    lib = ctypes.CDLL(str(native_build() / 'libedge_llm_ort_ops.so'))
    lib.elk_kernel_name.restype = ctypes.c_char_p
    lib.elk_select_kernel.argtypes = [ctypes.c_char_p]
    return lib


# (slot, start, length, bidirectional) rows of each call; slots 0 and 1 first hold 1000 and
# 700 positions from the first call.
CALLS = [
    [(0, 0, 1000, 0), (1, 0, 700, 0)],              # two long prefills
    [(1, 700, 250, 0), (0, 1000, 1, 0)],            # a chunk at 700, a decode step at 1000
    [(0, 1001, 40, 1), (1, 950, 3, 0)],             # a bidirectional chunk, a verify row
    [(1, 953, 1, 0)],                               # one decode row alone
]


@pytest.mark.parametrize('shape', [(12, 2, 128, 1100, 0, False), (9, 3, 64, 1100, 0, True),
                                   (8, 2, 80, 1100, 300, False), (4, 4, 6, 1100, 0, False)],
                         ids=['group6-d128', 'group3-d64-norms', 'window300-d80', 'mha-d6'])
@pytest.mark.parametrize('threads', [1, 2])
def test_the_op_gives_the_per_query_references_bits(shape, threads):
    heads, kv_heads, d, cap, window, norms = shape
    rng = np.random.default_rng(d + heads + threads)
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    ops = op_library()
    tiled = session(heads, kv_heads, d, cap, window, norms, threads)
    reference = session(heads, kv_heads, d, cap, window, norms, threads)
    # Garbage past every slot's positions: no query may read it.
    keys = rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32) * 50
    values = rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32) * 50
    want_k, want_v = keys.copy(), values.copy()
    for rows in CALLS:
        t = sum(r[2] for r in rows)
        feeds = {'q': rng.standard_normal((1, t, heads * d)).astype(np.float32) * 2,
                 'k': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32) * 2,
                 'v': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32),
                 'cos': cos, 'sin': sin, 'rows': np.array(rows, np.int32)}
        assert ops.elk_select_kernel(b'auto') == 0
        got = run(tiled, feeds, keys, values)
        try:
            assert ops.elk_select_kernel(b'scalar') == 0
            want = run(reference, feeds, want_k, want_v)
        finally:
            ops.elk_select_kernel(b'auto')
        assert got.tobytes() == want.tobytes(), rows
        assert keys.tobytes() == want_k.tobytes() and values.tobytes() == want_v.tobytes()


def test_the_op_equals_float64_attention_with_numpys_exp():
    """The softmax's own exp (a polynomial within 1 ulp of expf) keeps the op at float accuracy."""
    heads, kv_heads, d, cap = 4, 2, 64, 400
    rng = np.random.default_rng(3)
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle), np.sin(angle)
    t = 300
    q = rng.standard_normal((t, heads, d)) * 2
    k = rng.standard_normal((t, kv_heads, d)) * 2
    v = rng.standard_normal((t, kv_heads, d))
    feeds = {'q': q.reshape(1, t, -1).astype(np.float32),
             'k': k.reshape(1, t, -1).astype(np.float32),
             'v': v.reshape(1, t, -1).astype(np.float32),
             'cos': cos.astype(np.float32), 'sin': sin.astype(np.float32),
             'rows': np.array([(0, 0, t, 0)], np.int32)}
    keys = np.zeros((1, kv_heads, cap, d), np.float32)
    values = np.zeros_like(keys)
    got = run(session(heads, kv_heads, d, cap, 0, False, 1), feeds, keys, values)
    # The same attention in float64 over the float32 inputs: half-split rotary, causal softmax.
    half = d // 2

    def rotate(x):
        c, s = cos[:t, None, :], sin[:t, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    qr = rotate(feeds['q'].reshape(t, heads, d).astype(np.float64))
    kr = rotate(feeds['k'].reshape(t, kv_heads, d).astype(np.float64))
    vv = feeds['v'].reshape(t, kv_heads, d).astype(np.float64)
    group = heads // kv_heads
    want = np.empty((t, heads, d))
    for h in range(heads):
        scores = qr[:, h] @ kr[:, h // group].T / np.sqrt(d)
        scores += np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want[:, h] = (p / p.sum(-1, keepdims=True)) @ vv[:, h // group]
    np.testing.assert_allclose(got.reshape(t, heads, d), want, rtol=1e-4, atol=1e-5)


def shared_pair(heads: int, kv_heads: int, d: int, cap: int, window: int, q_norms, k_norm):
    """Build an owner node storing this call's K/V and a shared_kv node reading its present."""
    common = {'num_heads': heads, 'kv_num_heads': kv_heads, 'scale': 1.0, 'window': window,
              'norm_epsilon': 1e-6}
    owner = helper.make_node('CausalAttention', ['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin',
                                                 '', 'rows'], ['o', 'ok', 'ov'],
                             domain='edge_llm_ros', q_norm=q_norms[0], k_norm=k_norm, **common)
    reader = helper.make_node('CausalAttention', ['q2', '', '', 'ok', 'ov', '', '', 'cos', 'sin',
                                                  '', 'rows'], ['o2'], domain='edge_llm_ros',
                              q_norm=q_norms[1], shared_kv=1, **common)
    shapes = {'q': [1, 't', heads * d], 'q2': [1, 't', heads * d], 'k': [1, 't', kv_heads * d],
              'v': [1, 't', kv_heads * d], 'pk': ['n', kv_heads, cap, d],
              'pv': ['n', kv_heads, cap, d], 'cos': [cap, d // 2], 'sin': [cap, d // 2],
              'rows': ['r', 4]}
    graph = helper.make_graph(
        [owner, reader], 'shared',
        [helper.make_tensor_value_info(n, I32 if n == 'rows' else F, s)
         for n, s in shapes.items()],
        [helper.make_tensor_value_info('o', F, [1, 't', heads * d]),
         helper.make_tensor_value_info('o2', F, [1, 't', heads * d]),
         helper.make_tensor_value_info('ok', F, ['n', kv_heads, cap, d]),
         helper.make_tensor_value_info('ov', F, ['n', kv_heads, cap, d])])
    return op_session(graph, 1)


@pytest.mark.parametrize('window', [0, 40])
def test_a_shared_kv_node_reads_the_owners_keys_as_storing_them_again_would(window):
    """shared_kv (gemma4): the owner's present is read in the same run, nothing is stored.

    Its output equals, bit for bit, a plain node fed the same keys and values (which stores
    them again, the same bits) with the reader's queries and q_norm.
    """
    import onnxruntime as ort
    heads, kv_heads, d, cap = 4, 2, 64, 300
    rng = np.random.default_rng(11 + window)
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    q_norms = [list(rng.uniform(0.2, 0.4, d).astype(np.float32)) for _ in range(2)]
    k_norm = list(rng.uniform(0.2, 0.4, d).astype(np.float32))
    pair = shared_pair(heads, kv_heads, d, cap, window, q_norms, k_norm)
    names = ['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin', '', 'rows']
    node = helper.make_node('CausalAttention', names, ['o', 'ok', 'ov'], domain='edge_llm_ros',
                            num_heads=heads, kv_num_heads=kv_heads, scale=1.0, window=window,
                            q_norm=q_norms[1], k_norm=k_norm, norm_epsilon=1e-6)
    shapes = {'q': [1, 't', heads * d], 'k': [1, 't', kv_heads * d],
              'v': [1, 't', kv_heads * d], 'pk': ['n', kv_heads, cap, d],
              'pv': ['n', kv_heads, cap, d], 'cos': [cap, d // 2], 'sin': [cap, d // 2],
              'rows': ['r', 4]}
    reference = op_session(helper.make_graph(
        [node], 'reference',
        [helper.make_tensor_value_info(n, I32 if n == 'rows' else F, shapes[n])
         for n in names if n],
        [helper.make_tensor_value_info('o', F, [1, 't', heads * d]),
         helper.make_tensor_value_info('ok', F, ['n', kv_heads, cap, d]),
         helper.make_tensor_value_info('ov', F, ['n', kv_heads, cap, d])]), 1)
    keys = rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32) * 50
    values = rng.standard_normal((2, kv_heads, cap, d)).astype(np.float32) * 50
    want_k, want_v = keys.copy(), values.copy()
    for rows in ([(0, 0, 120, 0), (1, 0, 70, 0)], [(1, 70, 25, 0), (0, 120, 1, 0)],
                 [(0, 121, 1, 0)]):
        t = sum(r[2] for r in rows)
        feeds = {'q': rng.standard_normal((1, t, heads * d)).astype(np.float32),
                 'k': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32),
                 'v': rng.standard_normal((1, t, kv_heads * d)).astype(np.float32),
                 'cos': cos, 'sin': sin, 'rows': np.array(rows, np.int32)}
        q2 = rng.standard_normal((1, t, heads * d)).astype(np.float32)
        io = pair.io_binding()
        k, v = ort.OrtValue.ortvalue_from_numpy(keys), ort.OrtValue.ortvalue_from_numpy(values)
        for name, value in dict(feeds, q2=q2).items():
            io.bind_cpu_input(name, value)
        io.bind_ortvalue_input('pk', k)
        io.bind_ortvalue_input('pv', v)
        io.bind_output('o')
        io.bind_output('o2')
        io.bind_ortvalue_output('ok', k)
        io.bind_ortvalue_output('ov', v)
        pair.run_with_iobinding(io)
        got = io.copy_outputs_to_cpu()[1]
        want = run(reference, dict(feeds, q=q2), want_k, want_v)
        assert got.tobytes() == want.tobytes(), rows
        assert keys.tobytes() == want_k.tobytes() and values.tobytes() == want_v.tobytes()
