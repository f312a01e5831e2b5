"""The memory store and Memory over real SQLite + sqlite-vec files, and a process killed mid-write.

The embedding is memory_embed.hashed_embed (hashed trigrams), a deterministic stand-in: the
embedding models and llm_node's ~/embed are tested with them.
"""
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

from memory_embed import DIMS, hashed_embed, MODEL_ID
import numpy as np
import pytest

from edge_llm_ros.memory.errors import (EmptyInputError, FrameMismatchError,
                                        InvalidMemoryRequestError, MemoryStoreError,
                                        StoreModelMismatchError)
from edge_llm_ros.memory.memory import Memory, MemoryConfig
from edge_llm_ros.memory.reembed import reembed
from edge_llm_ros.memory.store import Filters, MemoryStore, Pose, row_nbytes, StoreConfig

CHILD = pathlib.Path(__file__).with_name('memory_store_child.py')


def open_memory(path, **kw):
    return Memory(MemoryStore(StoreConfig(str(path), **kw)), hashed_embed, MemoryConfig(max_k=10))


def test_recall_ranks_by_meaning_and_filters(tmp_path):
    memory = open_memory(tmp_path / 'm.db')
    now = time.time()
    charger = memory.remember('the charger is behind the kitchen door', Pose('map', 1, 2, 0),
                              ('place',), now - 100)[0]
    memory.remember('the charger cable is in the red box', Pose('map', 40, 0, 0), ('object',),
                    now - 50)
    memory.remember('grandma likes tea at five', None, ('person',), now)
    hits = memory.recall('where is the charger behind the door', 3)
    assert hits[0].id == charger and hits[0].pose == Pose('map', 1.0, 2.0, 0.0)
    assert [h.distance for h in hits] == sorted(h.distance for h in hits)
    assert hits[0].tags == ('place',)
    near = memory.recall('charger', 3, Filters(near=Pose('map', 38, 0, 0), radius_m=5.0))
    assert [h.text for h in near] == ['the charger cable is in the red box']
    assert [h.text for h in memory.recall('charger', 3, Filters(tags=('person',)))] == \
        ['grandma likes tea at five']
    window = memory.recall('charger', 3, Filters(since=now - 60, until=now - 10))
    assert [h.text for h in window] == ['the charger cable is in the red box']
    assert memory.recall('charger', 3, Filters(tags=('place', 'object'))) == []


def test_bounds_evict_the_oldest_rows(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger='edge_llm_ros.memory.store')
    memory = open_memory(tmp_path / 'm.db', max_rows=3)
    ids = [memory.remember(f'note {i}')[0] for i in range(3)]
    assert memory.remember('note 3') == (ids[-1] + 1, 1)
    assert 'evicted 1 oldest memories' in caplog.text
    assert memory.store.rows == 3
    assert {h.id for h in memory.recall('note', 10)} == {ids[1], ids[2], ids[2] + 1}
    row = row_nbytes('note x', (), DIMS)
    by_bytes = open_memory(tmp_path / 'b.db', max_bytes=2 * row + row // 2)
    for i in range(5):
        by_bytes.remember(f'note {i}')
    assert by_bytes.store.rows == 2 and by_bytes.store.nbytes <= 2 * row + row // 2
    with pytest.raises(InvalidMemoryRequestError, match='max_bytes'):
        by_bytes.remember('y' * (3 * row))


def test_forget_by_id_tag_and_age(tmp_path):
    memory = open_memory(tmp_path / 'm.db')
    now = time.time()
    a = memory.remember('old note', stamp=now - 3600)[0]
    b = memory.remember('tagged note', tags=('tmp',))[0]
    c = memory.remember('kept note')[0]
    memory.remember('another kept note')
    assert memory.forget(older_than_s=600) == 1
    assert memory.forget(tags=('tmp',)) == 1
    assert memory.forget(ids=(c, a, b)) == 1
    assert [h.text for h in memory.recall('note', 10)] == ['another kept note']
    with pytest.raises(InvalidMemoryRequestError, match='at least one'):
        memory.forget()


def test_bad_requests_are_typed(tmp_path):
    memory = open_memory(tmp_path / 'm.db')
    memory.remember('pallet at dock 3', Pose('map', 0, 0, 0))
    for text in ('', '   '):
        with pytest.raises(EmptyInputError):
            memory.remember(text)
        with pytest.raises(EmptyInputError):
            memory.recall(text, 1)
    for k in (0, 11):
        with pytest.raises(InvalidMemoryRequestError, match='max_k'):
            memory.recall('pallet', k)
    with pytest.raises(FrameMismatchError, match="transform the query pose into 'map'"):
        memory.recall('pallet', 1, Filters(near=Pose('odom', 0, 0, 0), radius_m=1.0))
    with pytest.raises(InvalidMemoryRequestError, match='radius_m'):
        memory.recall('pallet', 1, Filters(near=Pose('map', 0, 0, 0), radius_m=0.0))
    with pytest.raises(InvalidMemoryRequestError, match='since'):
        memory.recall('pallet', 1, Filters(since=10.0, until=5.0))
    with pytest.raises(InvalidMemoryRequestError, match='frame id'):
        memory.remember('x', Pose('', 0, 0, 0))
    assert len(memory.recall('pallet', 1)) == 1     # still serving


def test_another_model_is_refused_with_the_reembed_command(tmp_path):
    path = tmp_path / 'm.db'
    memory = open_memory(path)
    memory.remember('the red door leads to the lab', stamp=5.0, tags=('door',))
    memory.store.close()
    for model_id, dims in (('other-model', DIMS), (MODEL_ID, 32)):
        other = Memory(MemoryStore(StoreConfig(str(path))),
                       lambda t, q, m=model_id, d=dims: hashed_embed(t, q, d, m))
        with pytest.raises(StoreModelMismatchError, match='edge-llm-memory-reembed --store'):
            other.recall('door', 1)
        other.store.close()
    # The command's function: a new store of the new model, same rows.
    count = reembed(str(path), str(tmp_path / 'new.db'),
                    lambda t, q: hashed_embed(t, q, 32, 'other-model'))
    assert count == 1
    moved = Memory(MemoryStore(StoreConfig(str(tmp_path / 'new.db'))),
                   lambda t, q: hashed_embed(t, q, 32, 'other-model'))
    hit = moved.recall('door', 1)[0]
    assert (hit.text, hit.stamp, hit.tags) == ('the red door leads to the lab', 5.0, ('door',))


def test_foreign_busy_or_unwritable_files_are_store_errors(tmp_path):
    foreign = tmp_path / 'foreign.db'
    import sqlite3
    sqlite3.connect(foreign).execute('CREATE TABLE t (x)').connection.commit()
    with pytest.raises(MemoryStoreError, match='not a memory store'):
        MemoryStore(StoreConfig(str(foreign)))
    held = MemoryStore(StoreConfig(str(tmp_path / 'm.db')))
    with pytest.raises(MemoryStoreError, match='in use by another process'):
        MemoryStore(StoreConfig(str(tmp_path / 'm.db')))
    held.close()
    with pytest.raises(MemoryStoreError, match='is a directory'):
        MemoryStore(StoreConfig(str(tmp_path)))


# --- kill -9 mid-write ---------------------------------------------------------------------------
def test_kill_9_keeps_every_acknowledged_memory(tmp_path):
    store = tmp_path / 'memory.db'
    proc = subprocess.Popen([sys.executable, str(CHILD), str(store)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    events = []
    try:
        deadline = time.monotonic() + 120
        while not (events and events[-1].get('writing', -1) >= 40):
            assert time.monotonic() < deadline, events[-3:]
            line = proc.stdout.readline()
            assert line, f'the child exited: {proc.wait()} {proc.stderr.read()[-2000:]}'
            events.append(json.loads(line))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    events += [json.loads(line) for line in proc.stdout.read().splitlines() if line]
    acked = {ev['acked']: ev['id'] for ev in events if 'acked' in ev}
    writing = max(ev['writing'] for ev in events if 'writing' in ev)
    reopened = MemoryStore(StoreConfig(str(store)))   # the kernel dropped the child's lock
    rows = {h.id: h for h in reopened.all_rows()}
    for i, row_id in acked.items():
        assert row_id in rows, f'acknowledged memory {i} (id {row_id}) was lost'
        assert rows[row_id].text.startswith(f'note {i} ') and rows[row_id].tags == (f'n{i}',)
        assert rows[row_id].pose.x == float(i)
    assert len(rows) in (len(acked), len(acked) + 1)   # + the one being written, whole
    assert reopened.rows == len(rows)
    reopened.check_model(MODEL_ID, DIMS)
    hits = reopened.search(hashed_embed([f'note {writing - 1}'], True)[1][0], 1,
                           Filters(tags=(f'n{writing - 1}',)))
    assert hits and np.isfinite(hits[0].distance)
    reopened.close()
