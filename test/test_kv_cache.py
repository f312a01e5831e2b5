"""KV cache bookkeeping on plain arrays: reuse planning, sessions, int8 snapshots, no-room."""
import numpy as np
import pytest

from edge_llm_ros.engine.errors import ContextOverflowError
from edge_llm_ros.engine.kv_cache import (check_fits, common_prefix, dequantize_int8, KVCache,
                                          quantize_int8)

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

    def __init__(self, snapshot_dtype='float32', max_sessions=4):
        self.buffers = [np.zeros((1, KV_HEADS, CAP, HEAD_DIM), np.float32)
                        for _ in range(2 * LAYERS)]
        self.cache = KVCache(self.buffers, CAP, snapshot_dtype, max_sessions)
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
    assert m.cache.occupancy() == (2, CAP)
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
    assert m.cache.snapshot_bytes() == rows * (HEAD_DIM + 4)
    assert m.run(a + [17], 'A') == len(a)
    for got, want in zip(m.live(), m.expected()):
        # Half a quantization step of each row's max: |err| <= max|row| / 254.
        bound = np.abs(want).max(axis=-1, keepdims=True) / 254 + 1e-7
        assert np.all(np.abs(got[:, :, 1:len(a)] - want[:, :, 1:len(a)])
                      <= bound[:, :, 1:len(a)])
        assert not np.array_equal(got, want)  # int8 is lossy: the test would notice exact


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
