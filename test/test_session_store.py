"""Persisted sessions on a real SQLite file: round trips, eviction, dropped entries, bad files.

The KV buffers are plain arrays written with test_kv_cache's fake K/V (a position's rows depend
on the keys up to it), so what comes back from disk can be compared value by value.
"""
import json
import logging
import os
import pathlib
import shutil
import sqlite3
import tempfile

import numpy as np
import pytest
from test_kv_cache import CAP, FakeModel, POSITION_BYTES

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.conversation import Conversation, StoredImage
from edge_llm_ros.runtime.kv_cache import _Snapshot, block_hashes, dequantize_int8, KVCache
from edge_llm_ros.runtime.types import ChatMessage
from edge_llm_ros.serving import session_store
from edge_llm_ros.serving.engine import EngineConfig
from edge_llm_ros.serving.session_store import (decode_keys, encode_keys, KVLayout, model_hash,
                                                open_sessions, SessionStore, SessionStoreError)

A = [1, 10, 11, 12, 13, 14, 15, 16]
EMB = [('emb', 'ab' * 16, 0), ('emb', 'ab' * 16, 1), 7, 8, 9]


@pytest.fixture
def model_dir(tmp_path):
    """Write a stand-in model folder: the files model_hash reads."""
    d = tmp_path / 'model'
    d.mkdir()
    (d / 'model.yaml').write_text('name: fake\nconverter_version: x\n')
    (d / 'model.onnx').write_bytes(b'graph')
    (d / 'model.onnx.data').write_bytes(b'weights' * 100)
    return d


def row_ids(path: str) -> list:
    """Return the saved session ids on disk, least recently used first (own reader)."""
    db = sqlite3.connect(f'file:{path}?mode=ro', uri=True)
    try:
        return [r[0] for r in db.execute('SELECT session_id FROM sessions ORDER BY tick')]
    finally:
        db.close()


class Rig:
    """A FakeModel whose sessions persist in path, as an Engine would open it."""

    def __init__(self, model_dir, path, dtype='float32', max_bytes=1 << 20, max_sessions=8):
        self.config = EngineConfig(session_store=str(path), kv_dtype=dtype,
                                   session_max_bytes=max_bytes, max_sessions=max_sessions)
        # FakeModel's buffers have this shape: the layout is read from it.
        buffers = [np.zeros((1, 2, CAP, 8), np.float32) for _ in range(4)]
        self.store = open_sessions(self.config, str(model_dir), buffers, CAP)
        self.model = FakeModel(dtype, store=self.store)

    def turn(self, keys, session):
        self.model.run(keys, session)
        self.model.cache.checkpoint()

    @property
    def sink(self) -> SessionStore:
        return self.store._sink

    def close(self):
        self.model.cache.close()


def reopen(model_dir, path, **kw):
    rig = Rig(model_dir, path, **kw)
    return rig, rig.store


@pytest.mark.parametrize('dtype', ['float32', 'int8'])
def test_round_trip_restores_keys_and_kv_exactly(model_dir, tmp_path, dtype):
    path = tmp_path / 'sessions.db'
    rig = Rig(model_dir, path, dtype)
    rig.turn(A, 'a')
    rig.turn(EMB, 'emb')
    saved = {name: rig.store.get(name) for name in rig.store.ids()}
    rig.close()
    assert sqlite3.connect(path).execute('PRAGMA journal_mode').fetchone()[0] == 'wal'

    rig, store = reopen(model_dir, path, dtype=dtype)
    assert store.ids() == ['a', 'emb']
    for name, want in saved.items():
        got = store.get(name)
        assert got.keys == want.keys     # ('emb', digest, i) tuples come back as tuples
        for g, w in zip(got.data, want.data):
            assert g.dtype == (np.int8 if dtype == 'int8' else np.float32)
            assert np.array_equal(g, w)
        assert (got.scales is None) == (dtype == 'float32')
        for g, w in zip(got.scales or [], want.scales or []):
            assert np.array_equal(g, w)
    # The next turn of a restored session prefills only what is new.
    rig.model.run(A + [17], 'a')
    assert rig.model.prefilled == 1
    if dtype == 'float32':
        for got, want in zip(rig.model.live(), rig.model.expected()):
            assert np.array_equal(got, want)
    rig.close()


def test_keys_json_round_trip_and_refusal():
    assert decode_keys(encode_keys(EMB)) == tuple(EMB)
    images = [1, ('img', 'ab', 0), ('img', 'ab', 1), 2]
    assert decode_keys(encode_keys(images)) == tuple(images)
    for bad in ('[true]', '[["emb", 1, 2]]', '[1.5]', '[["pix", "x", 0]]', '[["img", "x"]]'):
        with pytest.raises(ValueError):
            decode_keys(bad)


def test_byte_bound_evicts_on_disk_too(model_dir, tmp_path):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path, max_bytes=20 * POSITION_BYTES)
    rig.turn(A, 'a')                       # 8 positions
    rig.turn([2] + A[1:], 'b')             # 8 more: 16 fit
    rig.turn([3] + A[1:], 'c')             # 24 > 20: a goes, in memory and on disk
    assert rig.store.ids() == ['b', 'c']
    assert rig.sink.flush(10)
    assert row_ids(rig.sink.path) == ['b', 'c']
    rig.model.run([2] + A[1:] + [5], 'b')  # b becomes the most recently used
    rig.close()
    rig, store = reopen(model_dir, path, max_bytes=20 * POSITION_BYTES)
    assert store.ids() == ['c', 'b']       # the LRU order survives the restart
    rig.close()
    # A smaller bound at the next start keeps the most recently used that fit.
    rig, store = reopen(model_dir, path, max_bytes=10 * POSITION_BYTES)
    assert store.ids() == ['b']
    assert row_ids(rig.sink.path) == ['b']
    rig.close()


def test_reset_deletes_close_keeps(model_dir, tmp_path):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    rig.turn(A, 'a')
    rig.turn([2, 3, 4], 'b')
    assert rig.model.cache.drop_session('a')
    rig.close()
    rig, store = reopen(model_dir, path)
    assert store.ids() == ['b']
    rig.model.cache.clear_sessions()       # ~/reset_session with no id: forget them all
    rig.close()
    rig, store = reopen(model_dir, path)
    assert store.ids() == []
    rig.close()


def test_repeated_saves_of_one_session_coalesce(model_dir, tmp_path):
    layout = KVLayout(4, 2, 8, 'float32', 'float32')
    sink = SessionStore(str(tmp_path / 's.db'), 'h', layout)   # writer not started yet
    m = FakeModel()
    for n in range(3, 8):
        m.run(A[:n], 'a')
        sink.save('a', _snap(m), None, n)
    sink.close()                           # commits what is pending
    assert sink.stats['saves'] == 1 and sink.stats['coalesced'] == 4


def _snap(m):
    n = m.cache.length
    return _Snapshot(m.cache.keys, [b[:, :, :n].copy() for b in m.buffers], None)


def _dropped_line(caplog):
    lines = [r.getMessage() for r in caplog.records if 'dropped' in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def test_another_model_is_dropped_with_one_line(model_dir, tmp_path, caplog):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    rig.turn(A, 'a')
    rig.turn([2, 3], 'b')
    rig.close()
    old = model_hash(str(model_dir))
    (model_dir / 'model.onnx.data').write_bytes(b'other weights')   # an updated model
    assert model_hash(str(model_dir)) != old
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.serving.session_store'):
        rig, store = reopen(model_dir, path)
    assert store.ids() == []
    line = _dropped_line(caplog)
    assert 'dropped 2' in line and '2 of another model' in line
    assert row_ids(rig.sink.path) == []        # deleted, not only skipped
    rig.close()


def test_another_models_conversations_are_kept_as_text(model_dir, tmp_path, caplog):
    # A model update: the KV and the ids were the old model's, the turns are still the
    # conversation. They come back as text (written back as this model's rows), and a
    # session with no conversation (a KV prefix alone) is dropped as before.
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    rig.turn(A, 'prefix-only')
    rig.model.run([5, 6, 7, 8], 'talk')
    rows = np.ones((3, 8), np.float32)
    said = Conversation(system='be brief', turns=(
        ChatMessage('user', 'what is this? <__media__>'), ChatMessage('assistant', 'a cup')),
        ids=(5, 6, 7, 8), images=(StoredImage(1, (3, (1, 3), 4), 'd' * 16, rows),))
    rig.model.cache.commit('talk', said)
    rig.close()
    (model_dir / 'model.onnx.data').write_bytes(b'new weights')   # the updated model
    new_hash = model_hash(str(model_dir))
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.serving.session_store'):
        rig, store = reopen(model_dir, path)
    assert store.ids() == ['talk'] and store.get('talk') is None
    kept = store.conversation('talk')
    assert kept == said.as_text()
    assert kept.ids == () and kept.images == () and kept.system == 'be brief'
    assert [t.content for t in kept.turns] == ['what is this? ', 'a cup']
    line = _dropped_line(caplog)
    assert 'kept 1 as text only' in line and '1 of another model' in line
    assert 'dropped 1' in line
    rig.close()   # flushes the write-back
    db = sqlite3.connect(path)
    assert db.execute('SELECT session_id, model_hash, positions FROM sessions').fetchall() == [
        ('talk', new_hash, 0)]
    db.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.serving.session_store'):
        rig, store = reopen(model_dir, path)   # now this model's row: restored as it is
    assert store.conversation('talk') == said.as_text()
    assert not [r for r in caplog.records if 'dropped' in r.getMessage()]
    rig.close()


def test_another_converter_version_or_layout_is_dropped(model_dir, tmp_path, caplog):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    for i in range(3):
        rig.turn([i + 1, 2, 3], f's{i}')
    rig.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE sessions SET converter_version = '0' WHERE session_id = 's0'")
    db.execute("UPDATE sessions SET positions = 99 WHERE session_id = 's1'")
    db.commit()
    db.close()
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.serving.session_store'):
        rig, store = reopen(model_dir, path)
    assert store.ids() == ['s2']
    line = _dropped_line(caplog)
    assert 'dropped 2' in line and 'converter version 0' in line and 'longer than' in line
    rig.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger='edge_llm_ros.serving.session_store'):
        rig, store = reopen(model_dir, path, dtype='int8')   # kv.dtype changed
    assert store.ids() == []
    assert 'another KV layout or kv.dtype' in _dropped_line(caplog)
    rig.close()


def test_model_hash_reads_graph_and_data_identity(model_dir):
    h = model_hash(str(model_dir))
    assert h == model_hash(str(model_dir))
    (model_dir / 'model.onnx').write_bytes(b'graph2')
    assert model_hash(str(model_dir)) != h


# --- bad input ---------------------------------------------------------------------------------
def _open_error(model_dir, path) -> str:
    with pytest.raises(SessionStoreError) as err:
        Rig(model_dir, path)
    assert isinstance(err.value, ModelLoadError)
    return str(err.value)


def test_garbage_file_is_refused(model_dir, tmp_path):
    path = tmp_path / 's.db'
    path.write_bytes(os.urandom(8192))
    msg = _open_error(model_dir, path)
    assert 'not a valid SQLite file' in msg and 'delete this one' in msg


def test_corrupt_store_is_refused(model_dir, tmp_path):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    for i in range(4):
        rig.turn(list(range(i, i + 30)), f's{i}')
    rig.close()
    size = path.stat().st_size
    with open(path, 'r+b') as f:      # keep the header page, wreck the b-tree pages
        f.seek(4096)
        f.write(os.urandom(size - 4096))
    msg = _open_error(model_dir, path)
    assert str(path) in msg and ('corrupt' in msg or 'not a valid' in msg), msg


def test_foreign_sqlite_file_is_refused(model_dir, tmp_path):
    path = tmp_path / 'app.db'
    db = sqlite3.connect(path)
    db.execute('CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)')
    db.commit()
    db.close()
    msg = _open_error(model_dir, path)
    assert 'another application' in msg and 'notes' in msg
    assert sqlite3.connect(path).execute('SELECT count(*) FROM notes').fetchone() == (0,)


def test_other_schema_version_is_refused(model_dir, tmp_path):
    path = tmp_path / 's.db'
    Rig(model_dir, path).close()
    db = sqlite3.connect(path)
    db.execute('PRAGMA user_version = 99')
    db.commit()
    db.close()
    assert 'schema version 99' in _open_error(model_dir, path)


def test_unwritable_path_is_refused(model_dir, tmp_path):
    blocker = tmp_path / 'a_file'
    blocker.write_text('x')
    msg = _open_error(model_dir, blocker / 'sessions.db')   # its "folder" is a file
    assert 'cannot be written' in msg and "sessions.store to ''" in msg
    assert 'is a directory' in _open_error(model_dir, tmp_path)


def _open_error_unprivileged(model_dir, path) -> str:
    """_open_error in a forked child that drops root (root may write read-only files)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                Rig(model_dir, path).close()
                msg = 'opened'
            except SessionStoreError as exc:
                msg = str(exc)
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, 'rb') as pipe:
        msg = pipe.read().decode()
    assert os.waitpid(pid, 0)[1] == 0
    return msg


def test_read_only_database_is_refused(model_dir):
    # A folder every user can read (pytest's tmp_path is root's only), so the child that
    # drops root can read the model files and open the store.
    base = pathlib.Path(tempfile.mkdtemp(prefix='ro_store_'))
    try:
        base.chmod(0o755)
        model = base / 'model'
        shutil.copytree(model_dir, model)
        for f in [model, *model.iterdir()]:
            f.chmod(0o755 if f.is_dir() else 0o644)
        path = base / 's.db'
        Rig(model, path).close()
        path.chmod(0o444)
        assert 'cannot be written' in _open_error_unprivileged(model, path)
    finally:
        shutil.rmtree(base)


def test_a_store_in_use_is_refused(model_dir, tmp_path):
    path = tmp_path / 's.db'
    rig = Rig(model_dir, path)
    assert 'in use by another process' in _open_error(model_dir, path)
    rig.close()
    Rig(model_dir, path).close()          # the lock goes with the store


def test_store_without_kept_sessions_is_refused(model_dir, tmp_path):
    config = EngineConfig(session_store=str(tmp_path / 's.db'), prefix_reuse=False)
    buffers = [np.zeros((1, 2, CAP, 8), np.float32)]
    with pytest.raises(SessionStoreError, match='kv.prefix_reuse'):
        open_sessions(config, str(model_dir), buffers, CAP)
    config = EngineConfig(session_max_bytes=-1)
    with pytest.raises(SessionStoreError, match='>= 0'):
        open_sessions(config, str(model_dir), buffers, CAP)


def test_module_has_no_rclpy():
    assert 'rclpy' not in pathlib.Path(session_store.__file__).read_text()


def test_when_written_waits_for_the_write(model_dir, tmp_path):
    layout = KVLayout(4, 2, 8, 'float32', 'float32')
    sink = SessionStore(str(tmp_path / 's.db'), 'h', layout)   # writer not started yet
    fired = []
    sink.when_written(lambda: fired.append('idle'))             # nothing pending: at once
    m = FakeModel()
    m.run(A, 'a')
    sink.save('a', _snap(m), None, 1)
    sink.when_written(lambda: fired.append('saved'))
    assert fired == ['idle']                                    # not on disk yet
    sink.start()
    assert sink.flush(30)
    assert fired == ['idle', 'saved'] and row_ids(str(tmp_path / 's.db')) == ['a']
    sink.save('a', _snap(m), None, 2)
    sink.when_written(lambda: fired.append('closed'))
    sink.close()                                                # close writes, then calls it
    assert fired[-1] == 'closed'


@pytest.mark.parametrize('dtype', ['float32', 'int8'])
def test_conv_states_round_trip_with_their_kept_ends(model_dir, tmp_path, dtype):
    path = tmp_path / 'sessions.db'
    config = EngineConfig(session_store=str(path), kv_dtype=dtype)
    buffers = [np.zeros((1, 2, CAP, 8), np.float32)]
    state = np.zeros((1, 2, 4), np.float32)
    store = open_sessions(config, str(model_dir), buffers, CAP, [state])
    cache = KVCache(buffers, CAP, dtype, store=store, states=[state])
    cache.apply(cache.find_reuse([1], block_hashes([1]), 0), 'a')
    cache.append([1, 2, 3])
    buffers[0][:, :, :3] = np.arange(48, dtype=np.float32).reshape(1, 2, 3, 8)
    state[...] = 3.0
    cache.mark()
    cache.append([4])
    state[...] = 4.0
    cache.commit('a', Conversation())
    cache.close()
    store2 = open_sessions(config, str(model_dir), buffers, CAP, [state])
    snap = store2.get('a')
    assert snap.keys == (1, 2, 3, 4) and sorted(snap.states) == [3, 4]
    # The states come back exact; int8 quantizes the KV rows only.
    assert all(a.dtype == np.float32 for st in snap.states.values() for a in st)
    assert np.all(snap.states[3][0] == 3.0) and np.all(snap.states[4][0] == 4.0)
    kv = snap.data[0][:, :, :3] if dtype == 'float32' else dequantize_int8(
        snap.data[0][:, :, :3], snap.scales[0][:, :, :3], np.float32)
    assert np.allclose(kv, np.arange(48).reshape(1, 2, 3, 8), rtol=0.01, atol=0.2)
    if dtype == 'float32':
        assert np.array_equal(kv, np.arange(48).reshape(1, 2, 3, 8))
    store2.close()
    # A model whose layer states differ cannot read those bytes: the conversation stays, as
    # text for the next turn to prefill.
    other = np.zeros((1, 3, 4), np.float32)
    store3 = open_sessions(config, str(model_dir), buffers, CAP, [other])
    assert store3.get('a') is None and store3.conversation('a') is not None
    store3.close()


def test_a_kv_only_layout_reads_as_before_conv_states(model_dir):
    layout = KVLayout.of([np.zeros((1, 2, CAP, 8), np.float32)], 'float32')
    assert layout.text() == json.dumps([1, 2, 8, 'float32', 'float32'])
    with pytest.raises(ValueError, match='conv states kept at'):
        layout.decode((1, 2), bytes(layout.nbytes(2)), [2])


def test_a_schema_3_store_is_upgraded_and_keeps_its_sessions(model_dir, tmp_path):
    path = tmp_path / 'sessions.db'
    rig = Rig(model_dir, path)
    rig.turn(A, 'a')
    rig.close()
    db = sqlite3.connect(path, isolation_level=None)   # as schema 3 wrote it
    db.execute('ALTER TABLE sessions DROP COLUMN state_ends')
    db.execute('PRAGMA user_version = 3')
    db.close()
    rig, store = reopen(model_dir, path)
    assert store.ids() == ['a'] and store.get('a').keys == tuple(A)
    rig.close()
