"""KV cache bookkeeping on plain arrays: reuse planning, sessions, int8 snapshots, no-room."""
import logging

import numpy as np
import pytest

from edge_llm_ros.errors import ContextOverflowError
from edge_llm_ros.runtime.conversation import Conversation, StoredImage
from edge_llm_ros.runtime.kv_cache import (_Snapshot, block_hashes, check_fits, common_prefix,
                                           dequantize_int8, KVCache, quantize_int8,
                                           SnapshotStore)

LAYERS, KV_HEADS, HEAD_DIM, CAP = 2, 2, 8, 32


def fake_kv(keys, layer):
    """Deterministic stand-in for K/V: position p's rows depend on keys[:p + 1] only."""
    out = np.zeros((1, KV_HEADS, len(keys), HEAD_DIM), np.float32)
    for p in range(len(keys)):
        seed = hash((tuple(keys[:p + 1]), layer)) % (2 ** 32)
        out[0, :, p] = np.random.default_rng(seed).standard_normal((KV_HEADS, HEAD_DIM))
    return out


class FakeModel:
    """Writes fake_kv into the buffers as a decoder would, through KVCache.plan/append."""

    def __init__(self, snapshot_dtype='float32', max_sessions=4, max_bytes=None, store=None):
        self.buffers = [np.zeros((1, KV_HEADS, CAP, HEAD_DIM), np.float32)
                        for _ in range(2 * LAYERS)]
        self.cache = KVCache(self.buffers, CAP, snapshot_dtype, max_sessions, store=store,
                             max_bytes=max_bytes)
        self.prefilled = 0

    def run(self, keys, session=''):
        start = self.cache.plan(keys, session)
        for i, buf in enumerate(self.buffers):
            buf[:, :, start:len(keys)] = fake_kv(keys, i)[:, :, start:]
        self.cache.append(keys[start:])
        self.prefilled = len(keys) - start
        return start

    def expected(self):
        keys = list(self.cache.keys)
        return [fake_kv(keys, i) for i in range(len(self.buffers))]

    def live(self):
        n = self.cache.length
        return [b[:, :, :n] for b in self.buffers]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([('emb', 'a', 0), 5], [('emb', 'b', 0), 5]) == 0


def test_fresh_then_shared_prefix_reuses_all_but_last():
    m = FakeModel()
    assert m.run([1, 2, 3, 4]) == 0
    assert m.run([1, 2, 3, 4]) == 3          # identical prompt: last position recomputed
    assert m.prefilled == 1
    assert m.run([1, 2, 9, 9, 9]) == 2
    assert m.cache.keys == (1, 2, 9, 9, 9)
    for got, want in zip(m.live(), m.expected()):
        np.testing.assert_array_equal(got, want)


def test_rewind_and_reset():
    m = FakeModel()
    m.run([5, 6, 7, 8])
    m.cache.rewind_to(2)
    assert (m.cache.length, m.cache.capacity) == (2, CAP)
    with pytest.raises(ValueError):
        m.cache.rewind_to(3)
    m.cache.reset()
    assert m.cache.length == 0 and m.cache.room() == CAP


def test_sessions_alternate_without_losing_prefixes():
    m = FakeModel()
    a = [1, 10, 11, 12, 13, 14]
    b = [1, 20, 21, 22, 23]
    m.run(a, 'A')
    m.run(b, 'B')                             # overwrites A's positions 1.. -> A saved lazily
    assert m.cache.sessions() == ['A']
    assert m.run(a + [15, 16], 'A') == len(a)  # A's whole prefix comes back from its snapshot
    assert m.cache.sessions() == ['B', 'A']  # A used last
    for got, want in zip(m.live(), m.expected()):
        np.testing.assert_array_equal(got, want)
    assert m.run(b + [24], 'B') == len(b)
    for got, want in zip(m.live(), m.expected()):
        np.testing.assert_array_equal(got, want)


def test_same_session_continuing_saves_nothing():
    m = FakeModel()
    m.run([1, 2, 3], 'A')
    m.run([1, 2, 3, 4, 5], 'A')
    assert m.cache.sessions() == []


def test_session_lru_evicts_oldest():
    m = FakeModel(max_sessions=2)
    for name, tail in (('A', 10), ('B', 20), ('C', 30), ('D', 40)):
        m.run([1, tail, tail + 1], name)
    assert m.cache.sessions() == ['B', 'C']   # D is live, A was evicted
    assert m.run([1, 10, 11, 12], 'A') == 1   # only the shared first token survives


def test_no_sessions_when_disabled():
    m = FakeModel(max_sessions=0)
    m.run([1, 2, 3], 'A')
    m.run([1, 4, 5], 'B')
    assert m.cache.sessions() == []
    assert m.run([1, 2, 3, 6], 'A') == 1


def test_int8_snapshot_restore_within_tolerance():
    m = FakeModel(snapshot_dtype='int8')
    a = [1, 10, 11, 12, 13, 14, 15, 16]
    m.run(a, 'A')
    m.run([1, 2, 3], 'B')
    # One int8 per value plus one float32 scale per (head, position) row.
    rows = len(m.buffers) * KV_HEADS * len(a)
    assert m.cache.store.nbytes() == rows * (HEAD_DIM + 4)
    assert m.run(a + [17], 'A') == len(a)
    for got, want in zip(m.live(), m.expected()):
        # Half a quantization step of each row's max: |err| <= max|row| / 254.
        bound = np.abs(want).max(axis=-1, keepdims=True) / 254 + 1e-7
        assert np.all(np.abs(got[:, :, 1:len(a)] - want[:, :, 1:len(a)])
                      <= bound[:, :, 1:len(a)])
        assert not np.array_equal(got, want)  # int8 is lossy: the test would notice exact


class Int8LiveModel:
    """Writes quantize_int8(fake_kv) into int8 live buffers and their scales (the op's job)."""

    def __init__(self, store=None):
        self.buffers = [np.zeros((1, KV_HEADS, CAP, HEAD_DIM), np.int8) for _ in range(4)]
        self.scales = [np.zeros((1, KV_HEADS, CAP, 1), np.float32) for _ in range(4)]
        self.cache = KVCache(self.buffers, CAP, 'int8', 4, store=store, scales=self.scales)

    def run(self, keys, session=''):
        start = self.cache.plan(keys, session)
        for i, (buf, scale) in enumerate(zip(self.buffers, self.scales)):
            q, s = quantize_int8(fake_kv(keys, i))
            buf[:, :, start:len(keys)] = q[:, :, start:]
            scale[:, :, start:len(keys)] = s[:, :, start:]
        self.cache.append(keys[start:])
        return start


def test_int8_live_snapshots_are_plain_copies_and_restore_exactly():
    m = Int8LiveModel()
    a = [1, 10, 11, 12, 13, 14, 15, 16]
    m.run(a, 'A')
    want = [b[:, :, :len(a)].copy() for b in m.cache.buffers]
    m.run([1, 2, 3], 'B')   # overwrites A's live rows after position 0: A is saved first
    snap = m.cache.store.get('A')
    assert snap is not None and snap.scales is not None
    assert all(d.dtype == np.int8 for d in snap.data)
    # The snapshot format of int8 snapshots (one int8 a value, one float32 scale a row).
    assert m.cache.store.nbytes() == len(m.buffers) * KV_HEADS * len(a) * (HEAD_DIM + 4)
    assert m.cache.live_bytes() == len(m.buffers) * KV_HEADS * 3 * (HEAD_DIM + 4)
    assert m.run(a + [17], 'A') == len(a)   # restored, not recomputed
    for got, expected in zip(m.cache.buffers, want):
        assert got[:, :, :len(a)].tobytes() == expected.tobytes()


def test_int8_live_rows_move_between_slots_with_their_scales():
    store = SnapshotStore(4)
    one, two = Int8LiveModel(store), Int8LiveModel(store)
    keys = [3, 4, 5, 6, 7]
    one.run(keys, 'A')
    reuse = two.cache.find_reuse(keys, block_hashes(keys), len(keys), others=[one.cache])
    assert reuse.source is one.cache
    assert two.cache.apply(reuse, 'A') == len(keys)   # copied from the other slot
    for a, b in zip(one.cache.buffers, two.cache.buffers):
        assert a[:, :, :len(keys)].tobytes() == b[:, :, :len(keys)].tobytes()


def test_int8_live_buffers_need_int8_kv_dtype_and_a_scale_each():
    bufs = [np.zeros((1, KV_HEADS, CAP, HEAD_DIM), np.int8) for _ in range(2)]
    scales = [np.zeros((1, KV_HEADS, CAP, 1), np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match='one scale buffer each'):
        KVCache(bufs, CAP, 'float32', scales=scales)
    with pytest.raises(ValueError, match='one scale buffer each'):
        KVCache(bufs, CAP, 'int8', scales=scales[:1])


def test_quantize_int8_roundtrip_and_zero_rows():
    x = np.random.default_rng(1).standard_normal((1, 2, 5, 16)).astype(np.float32)
    x[0, 1, 2] = 0.0
    q, s = quantize_int8(x)
    assert q.dtype == np.int8 and s.shape == (1, 2, 5, 1)
    y = dequantize_int8(q, s)
    assert np.all(np.abs(y - x) <= np.abs(x).max(axis=-1, keepdims=True) / 254 + 1e-7)
    assert np.all(y[0, 1, 2] == 0.0)


def test_embedding_keys_reuse_only_identical_content():
    m = FakeModel()
    e1 = [('emb', 'aaa', 0), ('emb', 'aaa', 1)]
    e2 = [('emb', 'bbb', 0), ('emb', 'bbb', 1)]
    m.run(e1 + [5, 6])
    assert m.run(e2 + [5, 6]) == 0
    assert m.run(e2 + [5, 7]) == 3


def test_no_room_is_a_value_and_a_typed_error():
    assert check_fits(10, 5, 20) is None
    msg = check_fits(18, 5, 20)
    assert 'prompt 18 tokens + max_tokens 5 > context 20' in msg and 'shorten' in msg
    m = FakeModel()
    with pytest.raises(ContextOverflowError, match='capacity'):
        m.cache.append(list(range(CAP + 1)))


def test_bad_construction():
    buf = [np.zeros((1, 2, 4, 8), np.float32)]
    with pytest.raises(ValueError, match='cannot hold'):
        KVCache(buf, 5)
    with pytest.raises(ValueError, match='kv_dtype'):
        KVCache(buf, 4, 'int4')


# --- byte bound --------------------------------------------------------------------------------
POSITION_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # one float32 position of every buffer


def snap_of(n, fill=1.0):
    """Return a float32 snapshot of n positions (n * POSITION_BYTES bytes)."""
    data = [np.full((1, KV_HEADS, n, HEAD_DIM), fill, np.float32) for _ in range(2 * LAYERS)]
    return _Snapshot(tuple(range(n)), data, None)


def test_byte_bound_evicts_least_recently_used():
    store = SnapshotStore(max_sessions=100, max_bytes=10 * POSITION_BYTES)
    for name in 'ABC':
        assert store.put(name, snap_of(3))
    store.touch('A')                       # A becomes the most recently used
    assert store.put('D', snap_of(3))      # 12 positions > 10: evict B, the oldest
    assert store.ids() == ['C', 'A', 'D']
    assert store.nbytes() == 9 * POSITION_BYTES
    assert store.put('E', snap_of(7))      # evicts C then A
    assert store.ids() == ['D', 'E'] and store.nbytes() == 10 * POSITION_BYTES
    assert store.put('D', snap_of(1))      # replacing a session counts its new size only
    assert store.nbytes() == 8 * POSITION_BYTES and store.ids() == ['E', 'D']
    assert store.pop('E') and not store.pop('E')
    assert store.nbytes() == POSITION_BYTES


def test_count_bound_still_applies_with_a_byte_bound():
    store = SnapshotStore(max_sessions=2, max_bytes=1000 * POSITION_BYTES)
    for name in 'ABC':
        store.put(name, snap_of(1))
    assert store.ids() == ['B', 'C']


def test_a_snapshot_larger_than_the_bound_is_not_kept(caplog):
    store = SnapshotStore(max_sessions=4, max_bytes=4 * POSITION_BYTES)
    assert store.put('A', snap_of(2))
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.runtime.kv_cache'):
        assert not store.put('A', snap_of(5))
    assert 'not kept' in caplog.text and 'sessions.max_bytes' in caplog.text
    # The older, shorter prefix of the session stays: it is still a valid prefix.
    assert store.ids() == ['A'] and len(store.get('A').keys) == 2


def with_image_rows(positions: int) -> Conversation:
    """Return a conversation holding one image of `positions` * POSITION_BYTES bytes of rows."""
    rows = np.zeros((positions, POSITION_BYTES // 4), np.float32)
    return Conversation(ids=(1, 2), images=(StoredImage(0, (positions,), 'd', rows),))


def test_image_rows_count_toward_the_byte_bound(caplog):
    store = SnapshotStore(max_sessions=100, max_bytes=10 * POSITION_BYTES)
    store.commit('A', with_image_rows(3), snap_of(2))  # 5 positions' worth
    store.commit('B', with_image_rows(3))              # 8
    assert store.nbytes() == 8 * POSITION_BYTES
    store.commit('C', with_image_rows(4))              # 12 > 10: A, the oldest, goes
    assert store.ids() == ['B', 'C'] and store.nbytes() == 7 * POSITION_BYTES
    # A prefix that fits alone but not beside its conversation's rows is not kept (logged);
    # the conversation is.
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.runtime.kv_cache'):
        store.commit('D', with_image_rows(6), snap_of(5))
    assert 'beside' in caplog.text and 'image rows' in caplog.text
    assert store.get('D') is None and store.conversation('D').images[0].rows == 6
    assert not store.put('D', snap_of(5)) and store.put('D', snap_of(4))
    # The session just saved stays even when its rows alone exceed the bound.
    store.commit('E', with_image_rows(12))
    assert store.ids() == ['E'] and store.conversation('E') is not None


def test_kvcache_respects_the_byte_bound():
    m = FakeModel(max_sessions=8, max_bytes=10 * POSITION_BYTES)
    m.run([1, 2, 3, 4], 'A')
    m.run([1, 5, 6, 7], 'B')
    m.run([1, 8, 9, 10], 'C')              # saves B: A + B = 8 positions fit
    assert m.cache.sessions() == ['A', 'B']
    m.run([1, 11, 12, 13], 'D')            # saves C: 12 > 10, A goes
    assert m.cache.sessions() == ['B', 'C']
    assert m.cache.store.nbytes() <= 10 * POSITION_BYTES
    m.run(list(range(20, 32)), 'E')        # saves D (4 positions)
    m.run([1, 2], 'F')                     # E's 12 positions alone exceed the bound
    assert 'E' not in m.cache.sessions()
    assert m.run(list(range(20, 33)), 'E') == 0


def test_checkpoint_is_a_no_op_without_persistence():
    m = FakeModel()
    m.run([1, 2, 3], 'A')
    assert not m.cache.checkpoint()
    assert m.cache.sessions() == []
    m.cache.close()
    assert m.cache.length == 0


def test_bad_byte_bound():
    with pytest.raises(ValueError, match='max_bytes'):
        SnapshotStore(max_bytes=-1)


def conv_cache():
    """Return a cache with one conv state [1, 2, 4] (a hybrid's) beside one KV buffer."""
    state = np.zeros((1, 2, 4), np.float32)
    cache = KVCache([np.zeros((1, 1, CAP, 2), np.float32)], CAP, states=[state])
    return cache, state


def test_conv_states_rewind_only_to_kept_positions():
    cache, state = conv_cache()
    assert not cache.rewindable
    cache.append([1, 2, 3])
    state[...] = 3.0
    cache.mark()                       # a prompt's end
    cache.append([4, 5])
    state[...] = 5.0
    cache.keep_undo()                  # a verify's start
    cache.append([6, 7, 8])
    state[...] = 8.0
    with pytest.raises(ValueError, match='no conv state was kept there'):
        cache.rewind_to(4)
    cache.rewind_to(5)                 # drafts rejected: back to the verify's start
    assert cache.keys == (1, 2, 3, 4, 5) and np.all(state == 5.0)
    with pytest.raises(ValueError, match='no conv state'):
        cache.rewind_to(4)             # the undo is used up
    cache.rewind_to(3)
    assert cache.length == 3 and np.all(state == 3.0)
    cache.rewind_to(0)                 # position 0: a row starting there reads zeros
    assert cache.length == 0


def test_conv_reuse_stops_at_kept_ends_of_this_slot_or_another():
    cache, state = conv_cache()
    other, other_state = conv_cache()
    other.append([1, 2, 3, 4])
    other_state[...] = 4.0
    other.mark()
    other.append([5, 6])
    other_state[...] = 6.0
    keys = [1, 2, 3, 4, 5, 9, 9]
    # Common prefix 5, but conv states exist at 4 (a mark) and 6 (the live end) only.
    reuse = cache.find_reuse(keys, block_hashes(keys), len(keys) - 1, [other])
    assert reuse.length == 4 and reuse.source is other
    cache.apply(reuse)
    assert cache.keys == (1, 2, 3, 4) and np.all(state == 4.0)
    longer = [1, 2, 3, 4, 5, 6, 7]
    reuse = cache.find_reuse(longer, block_hashes(longer), len(longer) - 1, [other], own=False)
    assert reuse.length == 6 and reuse.source is other   # the other slot's live end
    cache.apply(reuse)
    assert np.all(state == 6.0) and cache.length == 6
    assert cache.find_reuse(longer, block_hashes(longer), 5, [], own=True).length == 0


def test_a_conv_session_snapshot_keeps_its_states_at_its_kept_ends():
    store = SnapshotStore(max_sessions=4)
    state = np.zeros((1, 2, 4), np.float32)
    cache = KVCache([np.zeros((1, 1, CAP, 2), np.float32)], CAP, store=store, states=[state])
    cache.apply(cache.find_reuse([1], block_hashes([1]), 0), 'a')
    cache.append([1, 2, 3])
    state[...] = 3.0
    cache.mark()                       # turn 1's prompt end
    cache.append([4, 5])
    state[...] = 5.0                   # turn 1's end
    # Another session takes the slot: a's snapshot is saved with its states at 3 and 5.
    cache.apply(cache.find_reuse([7, 8], block_hashes([7, 8]), 1), 'b')
    cache.append([7])
    state[...] = 7.0
    snap = store.get('a')
    assert snap.keys == (1, 2, 3, 4, 5) and sorted(snap.states) == [3, 5]
    assert np.all(snap.states[3][0] == 3.0) and np.all(snap.states[5][0] == 5.0)
    assert snap.nbytes == sum(d.nbytes for d in snap.data) + 2 * state.nbytes
    # a's next turn extends the whole snapshot: restored to its end, states and all.
    keys = [1, 2, 3, 4, 5, 6]
    reuse = cache.find_reuse(keys, block_hashes(keys), len(keys) - 1)
    assert reuse.length == 5 and reuse.source is snap
    cache.apply(reuse, 'a')
    assert cache.keys == (1, 2, 3, 4, 5) and np.all(state == 5.0)
    # A prompt that leaves the snapshot at 4 continues from the kept prompt end, 3 (a's
    # snapshot, saved again as 'c' took the slot, still has it).
    cache.apply(cache.find_reuse([9], block_hashes([9]), 0), 'c')
    assert sorted(store.get('a').states) == [3, 5]
    keys = [1, 2, 3, 4, 9, 9]
    reuse = cache.find_reuse(keys, block_hashes(keys), len(keys) - 1)
    assert reuse.length == 3 and reuse.source is store.get('a')
    cache.apply(reuse, 'a')
    assert cache.keys == (1, 2, 3) and np.all(state == 3.0)
