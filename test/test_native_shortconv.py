"""ONNX Runtime's edge_llm_ros.ShortConv op (native/src/shortconv.cpp): LFM2's conv layers.

y = C * conv(B * x) over each row's conv state (B * x of its last kernel - 1 positions),
the state updated in place when it is bound as both past and present (as the engine binds
it). Checked against a NumPy float32 reference that adds the products in the op's order
(the state's oldest position first, from 0.0), bit for bit: one call over a prompt equals
the same positions fed in chunks or one at a time, a row equals itself in a batch, a row
that starts its sequence (seqlens_k + 1 == seq) reads zeros whatever the buffer holds, and
an unaliased present starts from past. Bad shapes are ORT errors that say what is wrong.
"""
from native_build import op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest

CHANNELS, KERNEL = 160, 3   # 160: two full blocks of 64 channels and a part


def session(weight: np.ndarray, threads: int = 2) -> ort.InferenceSession:
    """Build a one-node session: Y, present = ShortConv(X, W, past, seqlens_k), W fixed."""
    c, k = weight.shape
    node = helper.make_node('ShortConv', ['X', 'W', 'past', 'seqlens_k'], ['Y', 'present'],
                            domain='edge_llm_ros')
    graph = helper.make_graph(
        [node], 'shortconv',
        [helper.make_tensor_value_info('X', TensorProto.FLOAT, ['B', 'S', None]),
         helper.make_tensor_value_info('past', TensorProto.FLOAT, ['B', None, None]),
         helper.make_tensor_value_info('seqlens_k', TensorProto.INT32, ['B'])],
        [helper.make_tensor_value_info('Y', TensorProto.FLOAT, ['B', 'S', c]),
         helper.make_tensor_value_info('present', TensorProto.FLOAT, ['B', None, None])],
        [numpy_helper.from_array(weight, 'W')])
    return op_session(graph, threads)


def run(sess: ort.InferenceSession, x: np.ndarray, state: np.ndarray,
        starts) -> np.ndarray:
    """Run rows x [B, S, 3C] at positions starts[b]..; state [B, L-1, C] updated in place."""
    seqlens = np.asarray(starts, np.int32) + x.shape[1] - 1
    io = sess.io_binding()
    value = ort.OrtValue.ortvalue_from_numpy(state)
    io.bind_cpu_input('X', x)
    io.bind_cpu_input('seqlens_k', seqlens)
    io.bind_ortvalue_input('past', value)
    io.bind_output('Y')
    io.bind_ortvalue_output('present', value)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def reference(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple:
    """One row: x [S, 3C], state [L-1, C] -> (y [S, C], new state), in the op's float order."""
    c = weight.shape[0]
    product = x[:, :c] * x[:, 2 * c:]
    ext = np.concatenate([state, product])
    y = np.empty((x.shape[0], c), np.float32)
    for s in range(x.shape[0]):
        total = np.zeros(c, np.float32)
        for j in range(weight.shape[1]):
            total = total + ext[s + j] * weight[:, j]
        y[s] = x[s, c:2 * c] * total
    return y, ext[-(weight.shape[1] - 1):].copy()


@pytest.fixture(scope='module')
def weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((CHANNELS, KERNEL)).astype(np.float32)


@pytest.fixture(scope='module')
def sess(weight) -> ort.InferenceSession:
    return session(weight)


def inputs(seed: int, rows: int, positions: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(
        (rows, positions, 3 * CHANNELS)).astype(np.float32)


def test_a_prompt_equals_the_reference_in_one_call_in_chunks_and_one_at_a_time(sess, weight):
    x = inputs(2, 1, 13)
    want, want_state = reference(x[0], weight, np.zeros((KERNEL - 1, CHANNELS), np.float32))
    # The buffer holds garbage: position 0 reads zeros whatever it holds.
    state = np.full((1, KERNEL - 1, CHANNELS), 7.0, np.float32)
    np.testing.assert_array_equal(run(sess, x, state, [0])[0], want)
    np.testing.assert_array_equal(state[0], want_state)
    for cuts in ((0, 5, 6, 13), tuple(range(14))):
        state = np.full((1, KERNEL - 1, CHANNELS), -3.0, np.float32)
        got = [run(sess, np.ascontiguousarray(x[:, a:b]), state, [a])[0]
               for a, b in zip(cuts, cuts[1:])]
        np.testing.assert_array_equal(np.concatenate(got), want)
        np.testing.assert_array_equal(state[0], want_state)


def test_a_row_gives_its_own_bits_in_any_batch(sess, weight):
    rng = np.random.default_rng(3)
    rows = 5
    states = rng.standard_normal((rows, KERNEL - 1, CHANNELS)).astype(np.float32)
    starts = [4, 0, 9, 1, 30]
    for length in (1, 4):   # a decode step of every row; a verify pass of 4 positions
        x = inputs(4 + length, rows, length)
        batch_state = states.copy()
        batch = run(sess, x, batch_state, starts)
        for b in range(rows):
            alone_state = states[b:b + 1].copy()
            alone = run(session(weight, threads=1), np.ascontiguousarray(x[b:b + 1]),
                        alone_state, [starts[b]])
            np.testing.assert_array_equal(batch[b], alone[0])
            np.testing.assert_array_equal(batch_state[b], alone_state[0])
            fresh = np.zeros_like(states[b]) if starts[b] == 0 else states[b]
            want, want_state = reference(x[b], weight, fresh)
            np.testing.assert_array_equal(alone[0], want)
            np.testing.assert_array_equal(alone_state[0], want_state)


def test_an_unaliased_present_starts_from_past(sess, weight):
    x = inputs(5, 2, 3)
    past = np.random.default_rng(6).standard_normal((2, KERNEL - 1, CHANNELS)).astype(
        np.float32)
    y, present = sess.run(None, {'X': x, 'past': past,
                                 'seqlens_k': np.array([5, 2], np.int32)})
    for b, start in enumerate((3, 0)):
        fresh = past[b] if start else np.zeros_like(past[b])
        want, want_state = reference(x[b], weight, fresh)
        np.testing.assert_array_equal(y[b], want)
        np.testing.assert_array_equal(present[b], want_state)


def test_bad_shapes_are_errors_that_say_what_is_wrong(weight):
    sess = session(weight)
    good = {'X': inputs(7, 1, 2), 'past': np.zeros((1, KERNEL - 1, CHANNELS), np.float32),
            'seqlens_k': np.array([3], np.int32)}
    for key, value, message in (
            ('X', inputs(7, 1, 2)[..., :-1], r'input is not \[batch, seq, 3 x 160\]'),
            ('past', np.zeros((1, KERNEL, CHANNELS), np.float32),
             r'the state is not \[batch, kernel - 1, channels\] = \[1, 2, 160\]'),
            ('seqlens_k', np.array([3, 3], np.int32), 'one length per batch row'),
            ('seqlens_k', np.array([0], np.int32), 'row 0 starts at position -1')):
        with pytest.raises(Exception, match=message):
            sess.run(None, dict(good, **{key: value}))
    with pytest.raises(Exception, match=r'weight is not \[channels, kernel\] with a kernel '
                                        r'of 2\.\.16 positions: reconvert the model'):
        session(np.zeros((CHANNELS, 17), np.float32)).run(
            None, {'X': inputs(7, 1, 1), 'past': np.zeros((1, 16, CHANNELS), np.float32),
                   'seqlens_k': np.array([0], np.int32)})
