"""A conversation through a real llm_node on SmolLM2: remembered, across a restart and kill -9.

The model is asked which name its robot has, with the answer constrained to a choice among
the names (so the test checks memory, not the model's free wording): only the remembered
first turn makes it pick "Bolt".
"""
import contextlib
import os
import subprocess
import sys

from llm_node_harness import NodeProcess, RosClient, wait_for
import pytest
import rclpy

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript

pytestmark = pytest.mark.slow
REMEMBER = 'My name is Ada and my robot is called Bolt. Please remember both.'
QUESTION = 'What is the name of my robot?'
NAMES = ['Bolt', 'Echo', 'Rex', 'Max']


@contextlib.contextmanager
def node(name, params, client_name, transcripts=None):
    """Yield (process, LLMClient) once the node is active; it must stop cleanly (exit 0).

    transcripts: a list the node's ~/transcript records are appended to.
    """
    proc = NodeProcess(name, params)
    rclpy.init()
    client = RosClient(client_name)
    try:
        client.wait_state('/' + name, 'active', timeout=600)
        if transcripts is not None:
            transcripts.append(client.record(Transcript, f'/{name}/transcript'))
        yield proc, client.llm('/' + name)
    finally:
        client.close()
        rclpy.shutdown()
        if proc.returncode is None:
            assert proc.stop() == 0, proc.log()


def ask_name(chat):
    return chat.ask(QUESTION, choices=NAMES, timeout=300)


def test_the_robot_remembers_across_turns_a_restart_and_a_kill(tmp_path):
    name = f'llm_conversation_{os.getpid()}'
    store = tmp_path / 'sessions.db'
    params = {'autostart': True, 'sessions.store': str(store), 'max_tokens': 24,
              'sampling.temperature': 0.0}
    records = []
    with node(name, params, 'conversation_client_1', records) as (proc, llm):
        chat = llm.conversation('ada')
        told = chat.ask(REMEMBER, timeout=300)
        assert told.ok, told
        answer = ask_name(chat)
        assert answer.text == 'Bolt', answer
        # A session that was never told answers without that memory.
        other = llm.conversation('stranger').ask(QUESTION, choices=NAMES, timeout=300)
        assert other.ok
        history = chat.history(timeout=30)
        assert [(t.role, t.content) for t in history] == [
            ('user', REMEMBER), ('assistant', told.text), ('user', QUESTION),
            ('assistant', 'Bolt')]
        info = llm.get_session('ada', timeout=30)
        assert info.found and info.token_count > 0 and info.kv_bytes > 0
        assert set(llm.list_sessions(timeout=30).session_ids) == {'ada', 'stranger'}
        # The transcript of the question records the turns it continued (what replay needs).
        wait_for(lambda: any(r.prompt == QUESTION and r.session_id == 'ada'
                             for r in records[0]), 30, "the question's transcript")
        asked = [r for r in records[0] if r.session_id == 'ada' and r.prompt == QUESTION]
        assert len(asked) == 1 and asked[0].history_mode == Generate.Goal.HISTORY_APPEND
        assert [(m.role, m.content) for m in asked[0].session_turns] == [
            ('user', REMEMBER), ('assistant', told.text)]
        # The third turn reused the KV of the first two: it prefilled only its own tokens.
        third = chat.ask('Thank you.', timeout=300)
        assert third.timings.cached_prompt_tokens >= info.token_count - 3, third.timings

    # A clean restart: the conversation comes back from sessions.store, with its KV.
    with node(name, params, 'conversation_client_2') as (proc, llm):
        assert f'sessions.store {store}: 2 saved sessions restored' in proc.log()
        chat = llm.conversation('ada')
        again = ask_name(chat)
        assert again.text == 'Bolt', again
        assert again.timings.cached_prompt_tokens > 0
        assert len(chat.history(timeout=30)) == 8
        # From the shell: `edge-llm ask --session ada` continues the same conversation.
        shell = subprocess.run(
            [sys.executable, '-c', 'import sys; from edge_llm_ros.cli import main; '
             'sys.exit(main())', 'ask', '--server', '/' + name, '--session', 'ada',
             '--max-tokens', '8', 'Thanks again.'],
            capture_output=True, text=True, timeout=300)
        assert shell.returncode == 0, shell.stderr
        assert ' cached)' in shell.stderr, shell.stderr
        history = chat.history(timeout=30)
        assert [(t.role, t.content.strip()) for t in history[8:]] == [
            ('user', 'Thanks again.'), ('assistant', shell.stdout.strip())]
        # A new conversation, then the node is killed between its two turns.
        fresh = llm.conversation('kill9')
        assert fresh.ask(REMEMBER, timeout=300).ok
        proc.kill()
        assert proc.wait_exit(30) != 0

    with node(name, params, 'conversation_client_3') as (proc, llm):
        chat = llm.conversation('kill9')
        assert [t.content for t in chat.history(timeout=30)][:1] == [REMEMBER]
        answer = ask_name(chat)
        assert answer.text == 'Bolt', answer
        kept = llm.conversation('ada').history(timeout=30)
        assert len(kept) == 10 and kept[7].content == 'Bolt'
