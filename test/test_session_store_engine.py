"""Persisted sessions through a real Engine (tiny model) and through a process killed mid-write."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from compat_matrix import TINY_TYPES
import numpy as np
import pytest
from session_store_child import BUFFERS, HEAD_DIM, HEADS, POSITIONS, session_of
from tiny_model import tiny_model_dir

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.kv_cache import SnapshotStore
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.session_store import KVLayout, model_hash, SessionStore

HERE = pathlib.Path(__file__).resolve().parent
CHILD = HERE / 'session_store_child.py'
USER1 = ChatMessage('user', 'Hello, the sky is blue. What color is the sky?')
USER2 = ChatMessage('user', 'Is the sky blue?')


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp('tiny'), accuracy_level=0)


def config(tiny_dir, store='', **kw):
    return EngineConfig(model_dir=str(tiny_dir), max_context=256, session_store=str(store),
                        **kw)


def turn(engine, messages, session='chat'):
    return engine.generate(GenerationRequest(messages=list(messages), session_id=session,
                                             max_tokens=8)).run_to_end()


def two_turns(engine):
    first = turn(engine, [USER1])
    return first, turn(engine, [USER1, ChatMessage('assistant', first.text), USER2])


def test_a_restored_session_continues_as_without_restart(tiny_dir, tmp_path, compat):
    compat('llama', TINY_TYPES, 'sessions')
    store = tmp_path / 'sessions.db'
    e1 = Engine(config(tiny_dir, store))
    first = turn(e1, [USER1])
    e1.close()
    e2 = Engine(config(tiny_dir, store))
    assert e2.saved_sessions() == ['chat']
    second = turn(e2, [USER1, ChatMessage('assistant', first.text), USER2])
    e2.close()

    plain = Engine(config(tiny_dir))   # the same two turns, no store, no restart
    want_first, want_second = two_turns(plain)
    plain.close()
    assert first.token_ids == want_first.token_ids
    assert second.timings.cached_prompt_tokens > 0
    assert second.timings.cached_prompt_tokens == want_second.timings.cached_prompt_tokens
    assert second.token_ids == want_second.token_ids and second.text == want_second.text

    # Without the store the restart forgets the session: everything is prefilled again.
    fresh = Engine(config(tiny_dir))
    cold = turn(fresh, [USER1, ChatMessage('assistant', first.text), USER2])
    fresh.close()
    assert cold.timings.cached_prompt_tokens == 0
    assert cold.token_ids == second.token_ids


def test_reset_sessions_forgets_them_on_disk(tiny_dir, tmp_path):
    store = tmp_path / 'sessions.db'
    e = Engine(config(tiny_dir, store))
    turn(e, [USER1], 'a')
    turn(e, [USER2], 'b')
    assert e.reset_sessions('a') == 1
    e.close()
    e = Engine(config(tiny_dir, store))
    assert e.saved_sessions() == ['b']
    assert e.reset_sessions() == 1
    e.close()
    e = Engine(config(tiny_dir, store))
    assert e.saved_sessions() == []
    e.close()


def test_a_foreign_store_fails_engine_init_with_a_model_load_error(tiny_dir, tmp_path):
    store = tmp_path / 'not_ours.db'
    store.write_bytes(b'SQLite format 3\0' + os.urandom(4000))
    with pytest.raises(ModelLoadError, match='sessions.store'):
        Engine(config(tiny_dir, store))


# --- kill -9 mid-write ---------------------------------------------------------------------------
def read_events(proc, until, timeout):
    """Read the child's JSON lines until until(events) holds (AssertionError on timeout)."""
    events = []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert time.monotonic() < deadline, f'child events so far: {events[-5:]}'
        line = proc.stdout.readline()
        assert line, f'the child exited: {proc.wait()} {proc.stderr.read()[-2000:]}'
        events.append(json.loads(line))
    return events


def test_kill_9_mid_write_loses_at_most_the_session_being_written(tmp_path):
    model = tmp_path / 'model'
    model.mkdir()
    (model / 'model.yaml').write_text('name: big-kv\n')
    (model / 'model.onnx.data').write_bytes(b'w')
    store = tmp_path / 'sessions.db'
    proc = subprocess.Popen([sys.executable, str(CHILD), str(store), str(model)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Let every session be committed at least once, then kill during a write.
        events = read_events(proc, lambda ev: ev and ev[-1].get('writing', -1) >= 6, 120)
        time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    events += [json.loads(line) for line in proc.stdout.read().splitlines() if line]
    committed = {}
    for ev in events:
        if 'committed' in ev:
            committed[session_of(ev['committed'])] = ev['committed']
    writing = max(ev['writing'] for ev in events if 'writing' in ev)
    in_flight = session_of(writing) if committed.get(session_of(writing)) != writing else None

    layout = KVLayout(BUFFERS, HEADS, HEAD_DIM, 'float32', 'float32')
    sink = SessionStore(str(store), model_hash(str(model)), layout)  # opens, checks the file
    snaps = SnapshotStore(max_sessions=8, max_bytes=1 << 30, sink=sink)
    assert sink.restore_into(snaps, POSITIONS) >= 3
    for session, value in committed.items():
        snap = snaps.get(session)
        turn = snaps.conversation(session).turns
        if session == in_flight:   # the old version or the new one, never a mix
            assert snap is not None
            values = {float(np.unique(d)[0]) for d in snap.data}
            assert all(len(np.unique(d)) == 1 for d in snap.data)
            assert values in ({float(value)}, {float(writing)}), values
            assert [t.content for t in turn] == [str(int(values.pop()))]   # with its own KV
            continue
        assert snap is not None, f'{session} (committed as turn {value}) was lost'
        for d in snap.data:
            assert np.all(d == value), f'{session}: turn {value} not intact'
        assert [t.content for t in turn] == [str(value)], f'{session}: turn and KV differ'
    sink.start()
    snaps.put('after', snaps.get('s0'))   # the reopened store takes new writes
    snaps.close()
