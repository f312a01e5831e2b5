"""ONNX Runtime's edge_llm_ros.Mamba2 op (native/src/mamba2.cpp): Granite 4.0-H's SSM layers.

The causal depthwise conv + bias + SiLU over x | B | C (the conv inputs of each row's last
kernel - 1 positions kept in its state; native/src/causal_conv.cpp, shared with
GatedDeltaNet), the selective scan token by token over the row's [heads, d_state, head_dim]
state with B and C shared by the heads of a group, D x, the gate silu(z) and the grouped
RMSNorm, as llama.cpp's build_mamba2_layer computes them: checked against a float64 NumPy
transcription of that graph (within float32 rounding), and for the bits the engine relies on:
one call over a prompt equals the same positions in chunks or one at a time, a row equals
itself alone in any batch and on any number of threads, a row that starts its sequence reads
zeros whatever its slot holds, and the state after a call is what the next call continues
from. Bad shapes are ORT errors that say what is wrong. The AVX2 clones give the baseline
code's bits (native/tests/mamba2_check.cpp, built both ways).
"""
import pathlib
import subprocess

from native_build import op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest
from test_native_gated_delta import part, run

HEADS, HEAD_DIM, GROUPS, D_STATE, KERNEL, EPS = 4, 16, 2, 8, 4, 1e-5
INNER = HEADS * HEAD_DIM
CHANNELS = INNER + 2 * GROUPS * D_STATE
FLOATS = (KERNEL - 1) * CHANNELS + HEADS * D_STATE * HEAD_DIM
CONSTS = ('W', 'bias', 'dt_bias', 'a', 'd', 'norm')


@pytest.fixture(scope='module')
def weights() -> dict:
    rng = np.random.default_rng(1)
    return {'W': (rng.standard_normal((CHANNELS, KERNEL)) * 0.7).astype(np.float32),
            'bias': (0.2 * rng.standard_normal(CHANNELS)).astype(np.float32),
            'dt_bias': (0.5 * rng.standard_normal(HEADS)).astype(np.float32),
            'a': -rng.uniform(0.2, 2.0, HEADS).astype(np.float32),
            'd': rng.uniform(0.5, 1.5, HEADS).astype(np.float32),
            'norm': (1 + 0.1 * rng.standard_normal(INNER)).astype(np.float32)}


def session(weights: dict, threads: int = 2) -> ort.InferenceSession:
    """Build a one-node session over rows (the varlen form the converter writes)."""
    names = ['xbc', 'z', 'dt', *CONSTS, 'past', '', 'rows']
    node = helper.make_node('Mamba2', names, ['Y', 'present'], domain='edge_llm_ros',
                            heads=HEADS, head_dim=HEAD_DIM, groups=GROUPS, d_state=D_STATE,
                            epsilon=EPS)
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], 'mamba2',
        [helper.make_tensor_value_info('xbc', f, [1, 'T', None]),
         helper.make_tensor_value_info('z', f, [1, 'T', None]),
         helper.make_tensor_value_info('dt', f, [1, 'T', None]),
         helper.make_tensor_value_info('past', f, ['N', None]),
         helper.make_tensor_value_info('rows', TensorProto.INT32, ['R', 4])],
        [helper.make_tensor_value_info('Y', f, [1, 'T', INNER]),
         helper.make_tensor_value_info('present', f, ['N', None])],
        [numpy_helper.from_array(weights[k], k) for k in CONSTS])
    return op_session(graph, threads)


def tokens(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {'xbc': rng.standard_normal((1, n, CHANNELS)).astype(np.float32),
            'z': rng.standard_normal((1, n, INNER)).astype(np.float32),
            'dt': rng.standard_normal((1, n, HEADS)).astype(np.float32)}


def reference(x: dict, w: dict) -> np.ndarray:
    """llama.cpp's build_mamba2_layer after its projection, in float64, from zeros."""
    xbc = x['xbc'][0].astype(np.float64)
    n = xbc.shape[0]
    ext = np.concatenate([np.zeros((KERNEL - 1, CHANNELS)), xbc])
    conv = np.stack([sum(ext[t + j] * w['W'][:, j] for j in range(KERNEL)) for t in range(n)])
    conv = conv + w['bias']
    conv = conv / (1 + np.exp(-conv))
    s = np.zeros((HEADS, HEAD_DIM, D_STATE))   # ggml's [h, p, n]
    y = np.zeros((n, HEADS, HEAD_DIM))
    for t in range(n):
        xs = conv[t, :INNER].reshape(HEADS, HEAD_DIM)
        b = conv[t, INNER:INNER + GROUPS * D_STATE].reshape(GROUPS, D_STATE)
        c = conv[t, INNER + GROUPS * D_STATE:].reshape(GROUPS, D_STATE)
        dt = x['dt'][0, t] + w['dt_bias']
        dt = np.where(dt > 20, dt, np.log1p(np.exp(dt)))
        for h in range(HEADS):
            g = h // (HEADS // GROUPS)
            s[h] = s[h] * np.exp(dt[h] * w['a'][h]) + np.outer(xs[h] * dt[h], b[g])
            y[t, h] = s[h] @ c[g] + xs[h] * w['d'][h]
    z = x['z'][0].astype(np.float64)
    y = y.reshape(n, INNER) * z / (1 + np.exp(-z))
    y = y.reshape(n, GROUPS, -1)
    y = y / np.sqrt((y * y).mean(-1, keepdims=True) + EPS)
    return y.reshape(n, INNER) * w['norm']


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
            ('xbc', tokens(7, 2)['xbc'][..., :-1], rf'xbc is not \[batch, seq, {CHANNELS}\]'),
            ('dt', tokens(7, 2)['dt'][..., :-1], rf'dt is not \[1, 2, {HEADS}\]'),
            ('past', np.zeros((1, FLOATS - 1), np.float32), rf'state is not \[slots, {FLOATS}\]'),
            ('rows', np.array([[0, 0, 3, 0]], np.int32), 'sum to 3, not')):
        with pytest.raises(Exception, match=message):
            sess.run(None, dict(good, **{key: value}))


def test_the_avx2_clone_gives_the_baseline_bits(tmp_path):
    """native/tests/mamba2_check built with the AVX2 clones and without: one hash."""
    if 'avx2' not in pathlib.Path('/proc/cpuinfo').read_text():
        pytest.skip('this CPU has no AVX2: the library runs the baseline code only')
    root = pathlib.Path(__file__).resolve().parents[1] / 'native'
    hashes = []
    for flags in ([], ['-DELK_GDN_BASELINE']):
        exe = tmp_path / f'check{len(flags)}'
        subprocess.run(['g++', '-O3', '-std=gnu++17', '-ffp-contract=off', *flags,
                        f'-I{root / "include"}', str(root / 'tests' / 'mamba2_check.cpp'),
                        str(root / 'src' / 'mamba2.cpp'), str(root / 'src' / 'causal_conv.cpp'),
                        '-o', str(exe)], check=True)
        symbols = subprocess.run(['nm', str(exe)], capture_output=True, text=True).stdout
        assert ('elk_mamba2_scan_rows.avx2' in symbols) == (not flags)
        hashes.append(subprocess.run([str(exe)], capture_output=True, text=True,
                                     check=True).stdout)
    assert hashes[0] == hashes[1]
