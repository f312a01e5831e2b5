"""ONNX Runtime's edge_llm_ros.GatedDeltaNet op (native/src/gated_delta.cpp): Qwen3.5's layers.

The causal depthwise conv + SiLU over q, k, v (the conv inputs of each row's last kernel - 1
positions kept in its state), q/k L2 norms, the gated delta rule token by token over the
row's [heads, d_k, d_v] state, and the gated RMSNorm, as llama.cpp's build_layer_attn_linear
computes them: checked against a float64 NumPy transcription of that graph (within float32
rounding), and for the bits the engine relies on: one call over a prompt equals the same
positions in chunks or one at a time, a row equals itself alone in any batch and on any
number of threads, a row that starts its sequence reads zeros whatever its slot holds, and
the state after a call is what the next call continues from. Bad shapes are ORT errors that
say what is wrong. The AVX2 clone, and the aarch64 build's 4-float tiles under qemu, give the
baseline code's bits (native/tests/gated_delta_check.cpp, built both ways).
"""
import pathlib
import shutil
import subprocess

from native_build import native_build, op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest

from edge_llm_ros.convert.checkpoint import DELTA_CHUNK

K_HEADS, V_HEADS, D, KERNEL, EPS, CHUNK = 2, 4, 32, 4, 1e-6, 4
CHANNELS = (2 * K_HEADS + V_HEADS) * D
VALUE = V_HEADS * D
FLOATS = (KERNEL - 1) * CHANNELS + V_HEADS * (D * D + CHUNK * (2 * D + 1))


@pytest.fixture(scope='module')
def weights() -> dict:
    rng = np.random.default_rng(1)
    return {'W': (rng.standard_normal((CHANNELS, KERNEL)) * 0.7).astype(np.float32),
            'dt_bias': (0.5 * rng.standard_normal(V_HEADS)).astype(np.float32),
            'a': -rng.uniform(0.2, 2.0, V_HEADS).astype(np.float32),
            'norm': (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}


def session(weights: dict, threads: int = 2, **attrs) -> ort.InferenceSession:
    """Build a one-node session over rows (the varlen form the converter writes)."""
    names = ['qkv', 'z', 'alpha', 'beta', 'W', 'dt_bias', 'a', 'norm', 'past', '', 'rows']
    attrs = {'k_heads': K_HEADS, 'v_heads': V_HEADS, 'head_dim': D, 'epsilon': EPS,
             'chunk': CHUNK, **attrs}
    node = helper.make_node('GatedDeltaNet', names, ['Y', 'present'], domain='edge_llm_ros',
                            **{k: v for k, v in attrs.items() if v is not None})
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], 'gdn',
        [helper.make_tensor_value_info('qkv', f, [1, 'T', None]),
         helper.make_tensor_value_info('z', f, [1, 'T', None]),
         helper.make_tensor_value_info('alpha', f, [1, 'T', None]),
         helper.make_tensor_value_info('beta', f, [1, 'T', None]),
         helper.make_tensor_value_info('past', f, ['N', None]),
         helper.make_tensor_value_info('rows', TensorProto.INT32, ['R', 4])],
        [helper.make_tensor_value_info('Y', f, [1, 'T', VALUE]),
         helper.make_tensor_value_info('present', f, ['N', None])],
        [numpy_helper.from_array(weights[k], k) for k in ('W', 'dt_bias', 'a', 'norm')])
    return op_session(graph, threads)


def tokens(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {'qkv': rng.standard_normal((1, n, CHANNELS)).astype(np.float32),
            'z': rng.standard_normal((1, n, VALUE)).astype(np.float32),
            'alpha': rng.standard_normal((1, n, V_HEADS)).astype(np.float32),
            'beta': rng.standard_normal((1, n, V_HEADS)).astype(np.float32)}


def run(sess, x: dict, state: np.ndarray, rows) -> np.ndarray:
    """Run rows [(slot, start, length)] over x's packed tokens; state updated in place."""
    io = sess.io_binding()
    value = ort.OrtValue.ortvalue_from_numpy(state)
    for k, v in x.items():
        io.bind_cpu_input(k, np.ascontiguousarray(v))
    io.bind_cpu_input('rows', np.array([[s, p, n, 0] for s, p, n in rows], np.int32))
    io.bind_ortvalue_input('past', value)
    io.bind_output('Y')
    io.bind_ortvalue_output('present', value)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0][0]


def part(x: dict, a: int, b: int) -> dict:
    return {k: v[:, a:b] for k, v in x.items()}


def reference(x: dict, w: dict) -> np.ndarray:
    """llama.cpp's build_layer_attn_linear after its projections, in float64, from zeros."""
    qkv = x['qkv'][0].astype(np.float64)
    n = qkv.shape[0]
    ext = np.concatenate([np.zeros((KERNEL - 1, CHANNELS)), qkv])
    conv = np.stack([sum(ext[t + j] * w['W'][:, j] for j in range(KERNEL)) for t in range(n)])
    conv = conv / (1 + np.exp(-conv))
    s = np.zeros((V_HEADS, D, D))   # [h, i (key), j (value)]
    y = np.zeros((n, V_HEADS, D))
    for t in range(n):
        q = conv[t, :K_HEADS * D].reshape(K_HEADS, D)
        k = conv[t, K_HEADS * D:2 * K_HEADS * D].reshape(K_HEADS, D)
        v = conv[t, 2 * K_HEADS * D:].reshape(V_HEADS, D)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
        alpha = x['alpha'][0, t] + w['dt_bias']
        g = np.exp(np.where(alpha > 20, alpha, np.log1p(np.exp(alpha))) * w['a'])
        b = 1 / (1 + np.exp(-x['beta'][0, t].astype(np.float64)))
        for h in range(V_HEADS):
            kh = h % K_HEADS
            s[h] *= g[h]
            delta = (v[h] - k[kh] @ s[h]) * b[h]
            s[h] += np.outer(k[kh], delta)
            o = (q[kh] @ s[h]) / np.sqrt(D)
            o = o / np.sqrt((o * o).mean() + EPS) * w['norm']
            z = x['z'][0, t, h * D:(h + 1) * D].astype(np.float64)
            y[t, h] = o * z / (1 + np.exp(-z))
    return y.reshape(n, VALUE)


def test_a_prompt_is_the_reference_and_the_same_bits_in_chunks_and_one_at_a_time(weights):
    sess = session(weights)
    x = tokens(2, 13)
    state = np.full((1, FLOATS), 7.0, np.float32)   # garbage: position 0 reads zeros
    want = run(sess, x, state, [(0, 0, 13)])
    want_state = state.copy()
    ref = reference(x, weights)
    assert np.abs(want - ref).max() < 1e-4 * np.abs(ref).max()
    for cuts in ((0, 5, 6, 13), tuple(range(14))):
        state = np.full((1, FLOATS), -3.0, np.float32)
        got = [run(sess, part(x, a, b), state, [(0, a, b - a)]) for a, b in zip(cuts, cuts[1:])]
        np.testing.assert_array_equal(np.concatenate(got), want)
        np.testing.assert_array_equal(state, want_state)


def test_a_row_gives_its_own_bits_in_any_batch_and_on_any_threads(weights):
    rng = np.random.default_rng(3)
    slots = 5
    states = (0.3 * rng.standard_normal((slots, FLOATS))).astype(np.float32)
    starts, lengths = [4, 0, 9, 1, 30], [1, 3, 1, 4, 2]
    x = tokens(4, sum(lengths))
    batch_state = states.copy()
    batch = run(session(weights, threads=3), x, batch_state,
                list(zip(range(slots), starts, lengths)))
    offset = 0
    for slot in range(slots):
        n = lengths[slot]
        alone_state = states[slot:slot + 1].copy()
        alone = run(session(weights, threads=1), part(x, offset, offset + n), alone_state,
                    [(0, starts[slot], n)])
        np.testing.assert_array_equal(batch[offset:offset + n], alone)
        np.testing.assert_array_equal(batch_state[slot], alone_state[0])
        offset += n


def test_a_slot_no_row_names_is_not_touched(weights):
    state = np.random.default_rng(5).standard_normal((3, FLOATS)).astype(np.float32)
    before = state.copy()
    run(session(weights), tokens(6, 2), state, [(1, 3, 2)])
    np.testing.assert_array_equal(state[[0, 2]], before[[0, 2]])
    assert not np.array_equal(state[1], before[1])


def test_bad_shapes_are_errors_that_say_what_is_wrong(weights):
    sess = session(weights)
    good = dict(tokens(7, 2), past=np.zeros((1, FLOATS), np.float32),
                rows=np.array([[0, 0, 2, 0]], np.int32))
    for key, value, message in (
            ('qkv', tokens(7, 2)['qkv'][..., :-1], rf'qkv is not \[batch, seq, {CHANNELS}\]'),
            ('beta', tokens(7, 2)['beta'][..., :-1], r'beta is not \[1, 2, 4\]'),
            ('past', np.zeros((1, FLOATS - 1), np.float32), rf'state is not \[slots, {FLOATS}\]'),
            ('rows', np.array([[0, 0, 3, 0]], np.int32), 'sum to 3, not')):
        with pytest.raises(Exception, match=message):
            sess.run(None, dict(good, **{key: value}))


def test_the_avx2_clone_gives_the_baseline_bits(tmp_path):
    """native/tests/gated_delta_check built with the AVX2 clone and without: one hash."""
    if 'avx2' not in pathlib.Path('/proc/cpuinfo').read_text():
        pytest.skip('this CPU has no AVX2: the library runs the baseline code only')
    root = pathlib.Path(__file__).resolve().parents[1] / 'native'
    hashes = []
    for flags in ([], ['-DELK_GDN_BASELINE']):
        exe = tmp_path / f'check{len(flags)}'
        subprocess.run(['g++', '-O3', '-std=gnu++17', '-ffp-contract=off', *flags,
                        f'-I{root / "include"}', str(root / 'tests' / 'gated_delta_check.cpp'),
                        str(root / 'src' / 'gated_delta.cpp'),
                        str(root / 'src' / 'causal_conv.cpp'), '-o', str(exe)], check=True)
        symbols = subprocess.run(['nm', str(exe)], capture_output=True, text=True).stdout
        assert ('elk_gdn_delta_rows.avx2' in symbols) == (not flags)
        hashes.append(subprocess.run([str(exe)], capture_output=True, text=True,
                                     check=True).stdout)
    assert hashes[0] == hashes[1]


def test_the_aarch64_tiles_give_the_baseline_bits(tmp_path):
    """native/tests/gated_delta_check cross-built for aarch64 both ways, run under qemu: one hash.

    On aarch64 the op's tiles are 4-float NEON vectors (x86 takes 8 or 16): the same float
    expression per lane, so the same bits as the token-by-token baseline.
    """
    for tool in ('aarch64-linux-gnu-g++', 'qemu-aarch64-static'):
        if shutil.which(tool) is None:
            pytest.fail(f'{tool} is missing: scripts/arm64_rootfs.sh installs it '
                        '(apt-get install g++-aarch64-linux-gnu qemu-user-static)')
    root = pathlib.Path(__file__).resolve().parents[1] / 'native'
    hashes = []
    for flags in ([], ['-DELK_GDN_BASELINE']):
        exe = tmp_path / f'check{len(flags)}'
        subprocess.run(['aarch64-linux-gnu-g++', '-O3', '-std=gnu++17', '-ffp-contract=off',
                        *flags, f'-I{root / "include"}',
                        str(root / 'tests' / 'gated_delta_check.cpp'),
                        str(root / 'src' / 'gated_delta.cpp'),
                        str(root / 'src' / 'causal_conv.cpp'), '-o', str(exe)], check=True)
        hashes.append(subprocess.run(['qemu-aarch64-static', '-L', '/usr/aarch64-linux-gnu',
                                      str(exe)], capture_output=True, text=True, check=True,
                                     timeout=300).stdout)
    assert hashes[0] and hashes[0] == hashes[1]


@pytest.mark.parametrize('chunk, message', [
    (None, 'no chunk attribute .* reconvert the model'),   # an older converter's graph
    (0, 'chunk 0 .*chunk 1..64'), (65, 'chunk 65 .*chunk 1..64')])
def test_a_graph_without_a_valid_chunk_is_refused_with_what_to_do(weights, chunk, message):
    with pytest.raises(Exception, match=message):
        sess = session(weights, chunk=chunk)
        run(sess, tokens(8, 2), np.zeros((1, FLOATS), np.float32), [(0, 0, 2)])


def test_the_op_benchmark_times_the_chunked_form_and_writes_its_json(tmp_path):
    """bench/bench_gated_delta.py at Qwen3.5-2B's layer shape, a short run of this build."""
    import json
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'bench'))
    import bench_gated_delta
    out = tmp_path / 'results' / 'gdn.json'
    assert bench_gated_delta.main(['--lib', str(native_build() / 'libedge_llm_ort_ops.so'),
                                   '--prompt-tokens', '11', '--decode-steps', '2',
                                   '--repeats', '1', '--json-out', str(out)]) == 0
    got = json.loads(out.read_text())['libraries']['chunked']
    assert got['prefill_us_per_token'] > 0 and got['decode_us_per_token'] > 0
    assert got['state_kib'] == bench_gated_delta.state_floats(DELTA_CHUNK) * 4 / 1024
