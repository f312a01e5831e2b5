"""The row table ("varlen rows") of the op library's CausalAttention and ShortConv.

One call runs rows of different lengths on arbitrary buffer slots: the tokens come packed as
[1, T, ...] and an int32 table `rows` [R, 4] says each row's (slot, start, length,
bidirectional). Every row must give the bits it gives alone in the batched form (a B = 1 call
on its own slot): a position's arithmetic may not depend on what else is in the call. A slot
no row names is never read (NaN there changes nothing) nor written (its bytes stay). A bad
table is an ORT error that says what is wrong.
"""
from typing import Dict, List, Optional, Sequence

from native_build import op_session
import numpy as np
from onnx import helper, numpy_helper, TensorProto
import onnxruntime as ort
import pytest
from test_native_shortconv import reference as shortconv_reference

F, I32 = TensorProto.FLOAT, TensorProto.INT32

# ---------------------------------------------------------------------------------------------
# CausalAttention

HEADS, KV_HEADS, D, CAP = 4, 2, 16, 40
ATTENTION_INPUTS = ['q', 'k', 'v', 'pk', 'pv', 'sl', 'tot', 'cos', 'sin', 'bi', 'rows']


def attention_session(names: Sequence[str], window: int = 0, norms: bool = False,
                      packed: bool = False, threads: int = 2) -> ort.InferenceSession:
    """One CausalAttention node over the inputs `names` ('' = left out), KV bound in place."""
    attrs = {'num_heads': HEADS, 'kv_num_heads': KV_HEADS, 'scale': 0.3, 'window': window}
    if norms:
        rng = np.random.default_rng(99)
        attrs.update(q_norm=list(rng.uniform(0.5, 1.5, D).astype(np.float32)),
                     k_norm=list(rng.uniform(0.5, 1.5, D).astype(np.float32)),
                     norm_epsilon=1e-6)
    names = list(names)
    if packed:
        names[1] = names[2] = ''
    while names and not names[-1]:
        names.pop()
    width = (HEADS + 2 * KV_HEADS) * D if packed else HEADS * D
    shapes = {'q': ['b', 't', width], 'k': ['b', 't', KV_HEADS * D],
              'v': ['b', 't', KV_HEADS * D], 'pk': ['n', KV_HEADS, CAP, D],
              'pv': ['n', KV_HEADS, CAP, D], 'sl': ['b'], 'tot': [], 'cos': ['p', D // 2],
              'sin': ['p', D // 2], 'bi': [1], 'rows': ['r', None]}  # the op checks the 4
    types = {'sl': I32, 'tot': I32, 'bi': I32, 'rows': I32}
    node = helper.make_node('CausalAttention', names, ['o', 'ok', 'ov'],
                            domain='edge_llm_ros', **attrs)
    graph = helper.make_graph(
        [node], 'attention',
        [helper.make_tensor_value_info(n, types.get(n, F), shapes[n]) for n in names if n],
        [helper.make_tensor_value_info('o', F, ['b', 't', HEADS * D]),
         helper.make_tensor_value_info('ok', F, ['n', KV_HEADS, CAP, D]),
         helper.make_tensor_value_info('ov', F, ['n', KV_HEADS, CAP, D])])
    return op_session(graph, threads)


def rotary(positions: int = CAP):
    angle = np.arange(positions)[:, None] / (1e4 ** (np.arange(D // 2) / (D // 2)))
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def run_attention(sess: ort.InferenceSession, feeds: Dict[str, np.ndarray],
                  pk: np.ndarray, pv: np.ndarray) -> np.ndarray:
    """Run with pk/pv bound as both past and present (updated in place, as the engine does)."""
    io = sess.io_binding()
    keys, values = ort.OrtValue.ortvalue_from_numpy(pk), ort.OrtValue.ortvalue_from_numpy(pv)
    wanted = {i.name for i in sess.get_inputs()}
    for name, value in feeds.items():
        if name in wanted:
            io.bind_cpu_input(name, value)
    io.bind_ortvalue_input('pk', keys)
    io.bind_ortvalue_input('pv', values)
    io.bind_output('o')
    io.bind_ortvalue_output('ok', keys)
    io.bind_ortvalue_output('ov', values)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def tokens(rng, count: int, packed: bool) -> Dict[str, np.ndarray]:
    """Return the feeds q (k, v) of [1, count] tokens."""
    if packed:
        return {'q': rng.standard_normal((1, count, (HEADS + 2 * KV_HEADS) * D)).astype(
            np.float32)}
    return {n: rng.standard_normal((1, count, h * D)).astype(np.float32)
            for n, h in (('q', HEADS), ('k', KV_HEADS), ('v', KV_HEADS))}


def batched(sess, feeds, start: int, length: int, pk, pv, bidirectional: int = 0):
    """Run a B = 1 call of the batched form at positions start .. start + length - 1."""
    cos, sin = rotary()
    return run_attention(sess, dict(feeds, sl=np.array([start + length - 1], np.int32),
                                    tot=np.array(start + length, np.int32), cos=cos,
                                    sin=sin, bi=np.array([bidirectional], np.int32)), pk, pv)


def history(lengths: Sequence[int], seed: int, **options):
    """Return KV buffers [N, ...] whose slot i holds lengths[i] positions.

    Each slot is prefilled alone in the batched form; the rest of it is garbage that no query
    may read.
    """
    rng = np.random.default_rng(seed)
    sess = attention_session(ATTENTION_INPUTS[:10], **options)
    pk = rng.standard_normal((len(lengths), KV_HEADS, CAP, D)).astype(np.float32) * 50
    pv = rng.standard_normal((len(lengths), KV_HEADS, CAP, D)).astype(np.float32) * 50
    for slot, length in enumerate(lengths):
        k, v = pk[slot:slot + 1].copy(), pv[slot:slot + 1].copy()
        batched(sess, tokens(rng, length, options.get('packed', False)), 0, length, k, v)
        pk[slot], pv[slot] = k[0], v[0]
    return pk, pv


def pack(feeds_per_row: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {n: np.concatenate([f[n] for f in feeds_per_row], axis=1) for n in feeds_per_row[0]}


def check_rows_equal_alone(rows: Sequence[Sequence[int]], hist: Sequence[int], seed: int,
                           **options):
    """One rows-mode call equals each row run alone in the batched form, bit for bit."""
    rng = np.random.default_rng(seed)
    pk, pv = history(hist, seed, **options)
    per_row = [tokens(rng, length, options.get('packed', False)) for _, _, length, _ in rows]
    cos, sin = rotary()
    table = np.array(rows, np.int32)
    keys, values = pk.copy(), pv.copy()
    got = run_attention(attention_session(['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin',
                                           '', 'rows'], threads=4, **options),
                        dict(pack(per_row), cos=cos, sin=sin, rows=table), keys, values)
    assert got.shape == (1, sum(r[2] for r in rows), HEADS * D)
    alone = attention_session(ATTENTION_INPUTS[:10], threads=1, **options)
    want_k, want_v, offset = pk.copy(), pv.copy(), 0
    for (slot, start, length, bidirectional), feeds in zip(rows, per_row):
        k, v = pk[slot:slot + 1].copy(), pv[slot:slot + 1].copy()
        out = batched(alone, feeds, start, length, k, v, bidirectional)
        assert np.array_equal(got[:, offset:offset + length], out), (slot, start, length)
        want_k[slot], want_v[slot] = k[0], v[0]
        offset += length
    assert want_k.tobytes() == keys.tobytes() and want_v.tobytes() == values.tobytes()


HISTORY = (9, 4, 6)   # positions slots 0, 1, 2 hold before the call


@pytest.mark.parametrize('lengths', [(1, 7, 3), (1, 1, 2), (1, 20, 3)],
                         ids=['decode-prefill-verify', 'small-inline', 'multi-block'])
@pytest.mark.parametrize('options', [{}, {'window': 5}, {'norms': True},
                                     {'packed': True, 'window': 3, 'norms': True}],
                         ids=['plain', 'window', 'qk-norm', 'packed-window-norm'])
def test_attention_rows_equal_each_row_alone_in_the_batched_form(lengths, options):
    # Slot 2 decodes at its length, slot 0 takes a chunk at its length, slot 1 a verify row.
    rows = [(2, HISTORY[2], lengths[0], 0), (0, HISTORY[0], lengths[1], 0),
            (1, HISTORY[1], lengths[2], 0)]
    check_rows_equal_alone(rows, HISTORY, seed=sum(lengths) + len(options), **options)


@pytest.mark.parametrize('options', [{}, {'window': 4}])
def test_a_bidirectional_row_beside_a_causal_one(options):
    # Slot 0 an image chunk that sees itself both ways, slots 1 and 2 causal.
    rows = [(1, HISTORY[1], 3, 0), (0, HISTORY[0], 6, 1), (2, HISTORY[2], 1, 0)]
    check_rows_equal_alone(rows, HISTORY, seed=5, **options)
    # Bidirectional on a row of one token is the causal row.
    check_rows_equal_alone([(2, HISTORY[2], 1, 1), (0, HISTORY[0], 4, 1)], HISTORY, seed=6,
                           **options)


def test_a_row_starting_a_sequence_and_rows_in_any_order():
    rows = [(1, 0, 5, 0), (3, 2, 2, 0), (0, 7, 1, 0)]
    check_rows_equal_alone(rows, (7, 3, 0, 2), seed=11)


def test_attention_slots_no_row_names_are_neither_read_nor_written():
    rng = np.random.default_rng(21)
    pk, pv = history((5, 5, 3, 3), seed=21)
    # Slots 1 and 3 hold NaN: a read of them would show in the outputs.
    for slot in (1, 3):
        pk[slot] = pv[slot] = np.nan
    rows = [(2, 3, 2, 0), (0, 5, 4, 1)]
    per_row = [tokens(rng, length, False) for _, _, length, _ in rows]
    cos, sin = rotary()
    keys, values = pk.copy(), pv.copy()
    got = run_attention(attention_session(['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin',
                                           '', 'rows']),
                        dict(pack(per_row), cos=cos, sin=sin, rows=np.array(rows, np.int32)),
                        keys, values)
    assert np.isfinite(got).all()
    for slot in (1, 3):
        assert keys[slot].tobytes() == pk[slot].tobytes()
        assert values[slot].tobytes() == pv[slot].tobytes()
    for slot in (0, 2):
        assert not np.array_equal(keys[slot], pk[slot])


def test_a_zero_row_call_is_an_empty_output():
    pk, pv = history((2,), seed=3)
    keys, values = pk.copy(), pv.copy()
    cos, sin = rotary()
    got = run_attention(attention_session(['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin',
                                           '', 'rows']),
                        dict(tokens(np.random.default_rng(0), 0, False), cos=cos, sin=sin,
                             rows=np.zeros((0, 4), np.int32)), keys, values)
    assert got.shape == (1, 0, HEADS * D)
    assert keys.tobytes() == pk.tobytes() and values.tobytes() == pv.tobytes()


def attention_error(names: Sequence[str], message: str, rows: Optional[np.ndarray] = None,
                    batch: int = 1, count: int = 3, slots: int = 3, positions: int = CAP,
                    **feeds):
    sess = attention_session(names)
    rng = np.random.default_rng(0)
    cos, sin = rotary(positions)
    base = {n: rng.standard_normal((batch, count, h * D)).astype(np.float32)
            for n, h in (('q', HEADS), ('k', KV_HEADS), ('v', KV_HEADS))}
    base.update(cos=cos, sin=sin, bi=np.array([0], np.int32),
                sl=np.full(batch, count + 1, np.int32), tot=np.array(count + 2, np.int32))
    if rows is not None:
        base['rows'] = np.asarray(rows, np.int32)
    base.update(feeds)
    kv = np.zeros((slots, KV_HEADS, CAP, D), np.float32)
    with pytest.raises(Exception, match=message):
        run_attention(sess, base, kv.copy(), kv.copy())


ROWS_NAMES = ['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin', 'bi', 'rows']
GOOD = [(2, 4, 1, 0), (0, 3, 2, 0)]   # 3 tokens on slots 2 and 0 of 3


@pytest.mark.parametrize('rows, message, extra', [
    ([(2, 4, 1, 0, 0), (0, 3, 2, 0, 0)], r'CausalAttention: rows is not \[R, 4\] int32', {}),
    ([(3, 4, 1, 0), (0, 3, 2, 0)], r'row 0 names slot 3 outside 0\.\.2', {}),
    ([(2, 4, 1, 0), (-1, 3, 2, 0)], r'row 1 names slot -1 outside 0\.\.2', {}),
    ([(2, 4, 1, 0), (2, 3, 2, 0)], 'rows 0 and 1 both name slot 2', {}),
    ([(2, 4, 0, 0), (0, 3, 3, 0)], r'row 0 has length 0 \(< 1\)', {}),
    ([(2, 4, 1, 0), (0, -1, 2, 0)], 'row 1 starts at position -1', {}),
    ([(2, CAP - 1, 1, 0), (0, CAP - 1, 2, 0)],
     f'row 1 writes positions {CAP - 1}..{CAP} outside the KV capacity {CAP} or the rotary '
     'table', {}),
    ([(2, 4, 1, 0), (0, 9, 2, 0)],
     f'row 1 writes positions 9..10 outside the KV capacity {CAP} or the rotary table',
     {'positions': 10}),
    ([(2, 4, 1, 0), (0, 3, 3, 0)], "the rows' lengths sum to 4, not the input's 3 tokens", {}),
    (GOOD, r'with rows the input is \[1, T, \.\.\.\] .*not batch 2', {'batch': 2}),
    ([(2, 4, 1, 2), (0, 3, 2, 0)], "row 0's bidirectional is 2, not 0 or 1", {}),
    (GOOD, 'the bidirectional input must be absent or 0 with rows',
     {'bi': np.array([1], np.int32)}),
], ids=['shape', 'slot-high', 'slot-negative', 'slot-twice', 'length', 'start', 'capacity',
        'rotary', 'sum', 'batch', 'bidirectional', 'global-flag'])
def test_attention_bad_rows_are_errors_that_say_what_is_wrong(rows, message, extra):
    attention_error(ROWS_NAMES, message, rows, **extra)


def test_attention_takes_exactly_one_of_seqlens_and_rows():
    attention_error(ATTENTION_INPUTS, 'CausalAttention: give exactly one of seqlens_k .* '
                    'and rows .*not both', GOOD)
    attention_error(['q', 'k', 'v', 'pk', 'pv', '', '', 'cos', 'sin'],
                    'CausalAttention: give exactly one of seqlens_k .*not neither')


def test_the_batched_form_needs_no_total_sequence_length():
    rng = np.random.default_rng(8)
    pk, pv = history((4,), seed=8)
    feeds = tokens(rng, 3, False)
    with_tot = attention_session(ATTENTION_INPUTS[:9])
    without = attention_session(['q', 'k', 'v', 'pk', 'pv', 'sl', '', 'cos', 'sin'])
    k1, v1, k2, v2 = pk.copy(), pv.copy(), pk.copy(), pv.copy()
    a, b = batched(with_tot, feeds, 4, 3, k1, v1), batched(without, feeds, 4, 3, k2, v2)
    assert np.array_equal(a, b) and np.array_equal(k1, k2) and np.array_equal(v1, v2)


# ---------------------------------------------------------------------------------------------
# ShortConv

CHANNELS, KERNEL = 160, 3   # 160: two full blocks of 64 channels and a part


def shortconv_session(weight: np.ndarray, names: Sequence[str],
                      threads: int = 2) -> ort.InferenceSession:
    names = list(names)
    while names and not names[-1]:
        names.pop()
    shapes = {'X': ['b', 't', 3 * CHANNELS], 'past': ['n', KERNEL - 1, CHANNELS],
              'seqlens_k': ['b'], 'rows': ['r', None]}  # the op checks the 4
    node = helper.make_node('ShortConv', names, ['Y', 'present'], domain='edge_llm_ros')
    graph = helper.make_graph(
        [node], 'shortconv',
        [helper.make_tensor_value_info(n, I32 if n in ('seqlens_k', 'rows') else F,
                                       shapes[n]) for n in names if n and n != 'W'],
        [helper.make_tensor_value_info('Y', F, ['b', 't', CHANNELS]),
         helper.make_tensor_value_info('present', F, ['n', KERNEL - 1, CHANNELS])],
        [numpy_helper.from_array(weight, 'W')])
    return op_session(graph, threads)


def run_shortconv(sess, feeds: Dict[str, np.ndarray], state: np.ndarray) -> np.ndarray:
    """Run with the state bound as both past and present (updated in place)."""
    io = sess.io_binding()
    value = ort.OrtValue.ortvalue_from_numpy(state)
    for name, array in feeds.items():
        io.bind_cpu_input(name, array)
    io.bind_ortvalue_input('past', value)
    io.bind_output('Y')
    io.bind_ortvalue_output('present', value)
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


@pytest.fixture(scope='module')
def weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((CHANNELS, KERNEL)).astype(np.float32)


BATCHED_CONV = ['X', 'W', 'past', 'seqlens_k']
ROWS_CONV = ['X', 'W', 'past', '', 'rows']


@pytest.mark.parametrize('lengths', [(1, 5, 2), (1, 120, 2)], ids=['inline', 'pool'])
def test_shortconv_rows_equal_each_row_alone_in_the_batched_form(weight, lengths):
    rng = np.random.default_rng(sum(lengths))
    # Slot 2 decodes at 7, slot 0 starts its sequence (reads zeros, not the 9.0 there),
    # slot 1 continues at 3; slot 3 is no row's.
    states = rng.standard_normal((4, KERNEL - 1, CHANNELS)).astype(np.float32)
    states[0] = 9.0
    states[3] = np.nan
    rows = [(2, 7, lengths[0], 0), (0, 0, lengths[1], 1), (1, 3, lengths[2], 0)]
    per_row = [rng.standard_normal((1, length, 3 * CHANNELS)).astype(np.float32)
               for _, _, length, _ in rows]
    state = states.copy()
    got = run_shortconv(shortconv_session(weight, ROWS_CONV, threads=4),
                        {'X': np.concatenate(per_row, axis=1),
                         'rows': np.array(rows, np.int32)}, state)
    assert got.shape == (1, sum(lengths), CHANNELS)
    alone = shortconv_session(weight, BATCHED_CONV, threads=1)
    want, offset = states.copy(), 0
    for (slot, start, length, _), x in zip(rows, per_row):
        slot_state = states[slot:slot + 1].copy()
        seqlens = np.array([start + length - 1], np.int32)
        out = run_shortconv(alone, {'X': x, 'seqlens_k': seqlens}, slot_state)
        assert np.array_equal(got[:, offset:offset + length], out), (slot, start, length)
        fresh = np.zeros_like(states[slot]) if start == 0 else states[slot]
        ref, ref_state = shortconv_reference(x[0], weight, fresh)
        assert np.array_equal(out[0], ref) and np.array_equal(slot_state[0], ref_state)
        want[slot] = slot_state[0]
        offset += length
    assert state.tobytes() == want.tobytes()   # slot 3's NaN bytes untouched
    assert np.isfinite(got).all()


def shortconv_error(weight, names, message, rows=None, batch: int = 1, count: int = 3,
                    slots: int = 3, **feeds):
    sess = shortconv_session(weight, names)
    base = {'X': np.random.default_rng(0).standard_normal(
        (batch, count, 3 * CHANNELS)).astype(np.float32),
        'seqlens_k': np.full(batch, count + 1, np.int32)}
    if rows is not None:
        base['rows'] = np.asarray(rows, np.int32)
    base.update(feeds)
    wanted = {i.name for i in sess.get_inputs()}
    with pytest.raises(Exception, match=message):
        run_shortconv(sess, {n: v for n, v in base.items() if n in wanted},
                      np.zeros((slots, KERNEL - 1, CHANNELS), np.float32))


@pytest.mark.parametrize('rows, message, extra', [
    ([(2, 4, 1), (0, 3, 2)], r'ShortConv: rows is not \[R, 4\] int32', {}),
    ([(3, 4, 1, 0), (0, 3, 2, 0)], r'row 0 names slot 3 outside 0\.\.2', {}),
    ([(2, 4, 1, 0), (-1, 3, 2, 0)], r'row 1 names slot -1 outside 0\.\.2', {}),
    ([(0, 4, 1, 0), (0, 3, 2, 0)], 'rows 0 and 1 both name slot 0', {}),
    ([(2, 4, 1, 0), (0, 3, -2, 0)], r'row 1 has length -2 \(< 1\)', {}),
    ([(2, -3, 1, 0), (0, 3, 2, 0)], 'row 0 starts at position -3', {}),
    ([(2, 4, 1, 0), (0, 3, 1, 0)], "the rows' lengths sum to 2, not the input's 3 tokens", {}),
    (GOOD, r'with rows the input is \[1, T, \.\.\.\] .*not batch 2', {'batch': 2}),
    ([(2, 4, 1, 0), (0, 3, 2, -1)], "row 1's bidirectional is -1, not 0 or 1", {}),
], ids=['shape', 'slot-high', 'slot-negative', 'slot-twice', 'length', 'start', 'sum',
        'batch', 'bidirectional'])
def test_shortconv_bad_rows_are_errors_that_say_what_is_wrong(weight, rows, message, extra):
    shortconv_error(weight, ROWS_CONV, message, rows, **extra)


def test_shortconv_takes_exactly_one_of_seqlens_and_rows(weight):
    shortconv_error(weight, BATCHED_CONV + ['rows'],
                    'ShortConv: give exactly one of seqlens_k .*not both', GOOD)
    shortconv_error(weight, ['X', 'W', 'past'],
                    'ShortConv: give exactly one of seqlens_k .*not neither')
