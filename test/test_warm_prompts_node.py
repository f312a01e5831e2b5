"""llm_node with kv.warm_prompts and sessions.store on SmolLM2: a warm prompt survives a restart.

The agent's system prompt is a warm prompt: prefilled at the first configure, restored from
sessions.store at the second without a prefill, and the first goal after the restart reuses
all of its tokens. ~/get_model_info and /diagnostics list it (prefilled, then restored);
~/warm_prompt adds one at run time and answers bad input (unreadable, longer than the
context, over kv.memory_limit) with what to change while the node keeps serving. A request
through the OpenAI bridge with that system message reuses it too (its transcript says so).
"""
import os

from agent_harness import transcript_of
import httpx
from llm_node_harness import NodeProcess, served_process
import pytest

from edge_llm_msgs.msg import Transcript
from edge_llm_ros.convert.default_model import ensure_default_model
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.node_process import NodeProcess as AnyNodeProcess
from edge_llm_ros.nodes.openai_bridge import wait_serving
from edge_llm_ros.serving.engine import kv_budget_bytes
from edge_llm_ros.serving.warm_prompts import snapshot_bytes

pytestmark = pytest.mark.slow
SYSTEM = ('You are the voice of a hospital delivery robot. You can go to the pharmacy, the '
          'lift and rooms 1 to 12. Answer in one short sentence.')


def node(name, params, client_name):
    """Return the active node's (process, client, llm) block (llm_node_harness)."""
    return served_process(name, params, client_name, timeout=600)


def ask(llm, question):
    result = llm.generate(messages=[('system', SYSTEM), ('user', question)]).result(timeout=300)
    assert result.ok, result
    return result


def test_a_warm_prompt_survives_a_node_restart(tmp_path, native_library):
    name = f'llm_warm_{os.getpid()}'
    store = tmp_path / 'sessions.db'
    # Room for 100 tokens of warm prompts beside the KV slot and sessions.max_bytes.
    info = load_model_info(str(ensure_default_model()))
    limit = kv_budget_bytes(info, 512, 1) + (256 << 20) + snapshot_bytes(info, 100, 'float32')
    params = {'autostart': True, 'sessions.store': str(store), 'max_tokens': 4,
              'kv.max_context': 512, 'kv.warm_prompts': [SYSTEM], 'kv.memory_limit': limit,
              'sessions.max_bytes': 256 << 20, 'engine.parallel_sequences': 1}
    with node(name, params, 'warm_client_1') as (proc, client, llm):
        info = llm.model_info(timeout=30)
        (tokens,) = info.warm_prompt_tokens
        assert info.warm_prompts == [SYSTEM[:40] + '...'] and info.warm_prompt_bytes[0] > 0
        status = client.next_status('/' + name, timeout=30)
        assert status['warm_prompts'] == '1', status
        assert status['warm_prompt_0'].startswith(f'{tokens} tokens, '), status
        assert ', prefilled: ' in status['warm_prompt_0'], status
        # Bad input on the service: a typed error saying what to change; the node serves on.
        for kwargs, words in (({'path': str(tmp_path / 'map.txt')}, 'cannot be read'),
                              ({'text': 'corridor ' * 600}, 'raise kv.max_context'),
                              ({'text': 'corridor ' * 100}, 'raise kv.memory_limit')):
            answer = llm.warm_prompt(**kwargs, timeout=120)
            assert not answer.success and words in answer.message, answer
        (tmp_path / 'map.txt').write_text('You are a hospital map. Name the floor of a room.')
        added = llm.warm_prompt(path=str(tmp_path / 'map.txt'), timeout=120)
        assert added.success and added.tokens > 0 and added.bytes > 0, added
        assert list(llm.model_info(timeout=30).warm_prompt_tokens) == [tokens, added.tokens]
        first = ask(llm, 'Where is the pharmacy?')
    assert f'{tokens} tokens, {info.warm_prompt_bytes[0]} bytes pinned, prefilled' in proc.log()
    assert first.timings.cached_prompt_tokens >= tokens
    with node(name, params, 'warm_client_2') as (proc, client, llm):
        log = proc.log()
        # The run-time one is gone (not in kv.warm_prompts); the configured one came back.
        assert list(llm.model_info(timeout=30).warm_prompt_tokens) == [tokens]
        status = client.next_status('/' + name, timeout=30)
        assert status['warm_prompt_0'].startswith(
            f'{tokens} tokens, {info.warm_prompt_bytes[0]} bytes, restored from sessions.store'
            ': '), status
        second = ask(llm, 'Take me to room 4.')
        # ~/reset_session '' empties the live caches too: only the pinned copy is left.
        assert llm.reset_session(timeout=30).success
        bridged = bridge_request(client, name, 'Bring towels to room 9.')
    assert f'{tokens} tokens, {info.warm_prompt_bytes[0]} bytes pinned, restored from ' \
        'sessions.store' in log, log
    # The first goal after the restart: the whole warm prompt from the store, nothing more.
    assert second.timings.cached_prompt_tokens == tokens, second.timings
    assert second.timings.prefill_tokens == second.prompt_tokens - tokens
    assert bridged.timings.cached_prompt_tokens == tokens, bridged.timings


def bridge_request(client, name, question):
    """Send one chat completion through an openai_bridge process; return its transcript."""
    transcripts = client.record(Transcript, f'/{name}/transcript')
    bridge = AnyNodeProcess('openai_bridge', name=f'{name}_bridge', stop_timeout=30.0,
                            params={'port': 0, 'llm_node': '/' + name})
    try:
        url = wait_serving(bridge, timeout=60)
        reply = httpx.post(f'{url}/chat/completions', timeout=120, json={
            'model': 'edge-llm', 'max_tokens': 4, 'messages': [
                {'role': 'system', 'content': SYSTEM}, {'role': 'user', 'content': question}]})
        assert reply.status_code == 200, reply.text
    finally:
        assert bridge.stop() == 0, bridge.log()
    return transcript_of(transcripts, question)


def test_an_unreadable_warm_prompt_fails_configure_with_what_to_do(tmp_path, native_library):
    name = f'llm_warm_bad_{os.getpid()}'
    missing = tmp_path / 'missing_map.txt'
    proc = NodeProcess(name, {'autostart': True, 'kv.warm_prompts': [f'file:{missing}']})
    try:
        proc.wait_output('configure failed', timeout=300)
        assert proc.proc.poll() is None   # unconfigured, still up (configure may be retried)
    finally:
        assert proc.stop() == 0, proc.log()
    assert f'WarmPromptError: warm prompt file {missing} cannot be read' in proc.log()
