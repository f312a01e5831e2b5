"""llm_node with sessions.store on SmolLM2: a session survives a stop and a start."""
import os

from llm_node_harness import NodeProcess, served_process
import pytest

pytestmark = pytest.mark.slow
QUESTION = ('user', 'What color is the sky? Answer in one sentence.')


def node(name, params, client_name):
    """Return the active node's (process, client, llm) block (llm_node_harness)."""
    return served_process(name, params, client_name, timeout=600)


def test_a_session_survives_a_node_restart(tmp_path):
    name = f'llm_sessions_{os.getpid()}'
    store = tmp_path / 'sessions.db'
    params = {'autostart': True, 'sessions.store': str(store), 'max_tokens': 16}
    with node(name, params, 'sessions_client_1') as (proc, _, llm):
        first = llm.generate(messages=[QUESTION], session_id='robot_1').result(timeout=300)
        assert first.ok, first
    assert f'sessions.store {store}: 0 saved sessions restored' in proc.log()
    history = [QUESTION, ('assistant', first.text), ('user', 'And at night?')]
    with node(name, params, 'sessions_client_2') as (proc, _, llm):
        assert f'sessions.store {store}: 1 saved sessions restored' in proc.log()
        second = llm.generate(messages=history, session_id='robot_1').result(timeout=300)
        assert second.ok, second
    # The first turn's prompt (and answer) came from the store: only the new turn is prefilled.
    assert second.timings.cached_prompt_tokens >= first.prompt_tokens, second.timings
    assert second.timings.prefill_tokens <= second.prompt_tokens - first.prompt_tokens


def test_a_foreign_store_fails_configure_with_what_to_do(tmp_path):
    name = f'llm_sessions_bad_{os.getpid()}'
    store = tmp_path / 'other_app.db'
    store.write_bytes(b'not a database at all' * 100)
    proc = NodeProcess(name, {'autostart': True, 'sessions.store': str(store)})
    try:
        proc.wait_output('configure failed', timeout=300)
    finally:
        proc.stop()
    assert 'SessionStoreError' in proc.log() and 'not a valid SQLite file' in proc.log()
