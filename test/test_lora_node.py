"""llm_node's LoRA pieces without spinning: the adapter services' answers and Generate.lora.

The services' functions (nodes/llm_adapters.py) answer from an engine with the tiny llama and
its adapters (test_lora_engine's files); a goal's LoraScale entries become the request's
name -> scale (a name twice is refused), and make_goal fills them.
"""
import pytest
from test_lora_engine import engine, files  # noqa: F401 - the module's fixture

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import LoraScale
from edge_llm_msgs.srv import ListAdapters, LoadAdapter, UnloadAdapter
from edge_llm_ros.client import make_goal
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.nodes.llm_adapters import list_adapters, load_adapter, unload_adapter
from edge_llm_ros.nodes.messages import lora_scales


def test_services_load_list_unload(files):  # noqa: F811
    eng = engine(files)
    try:
        listed = list_adapters(eng, ListAdapters.Response())
        assert [a.name for a in listed.adapters] == ['one', 'two']
        assert listed.adapters[0].rank == 8 and listed.adapters[1].default_scale == 0.5
        request = LoadAdapter.Request(name='three', path=str(files[1][1]), default_scale=2.0)
        loaded = load_adapter(eng, request, LoadAdapter.Response(), 'unloaded')
        assert loaded.success, loaded.message
        again = load_adapter(eng, request, LoadAdapter.Response(), 'unloaded')
        assert not again.success and 'loaded already' in again.message
        bad = load_adapter(eng, LoadAdapter.Request(name='x', path='/nope.gguf'),
                           LoadAdapter.Response(), 'unloaded')
        assert not bad.success and 'does not exist' in bad.message
        gone = unload_adapter(eng, UnloadAdapter.Request(name='three'),
                              UnloadAdapter.Response(), 'unloaded')
        assert gone.success and gone.unloaded_now
        missing = unload_adapter(eng, UnloadAdapter.Request(name='three'),
                                 UnloadAdapter.Response(), 'unloaded')
        assert not missing.success and 'no adapter' in missing.message
    finally:
        eng.close()
    idle = load_adapter(None, LoadAdapter.Request(name='x', path='p'), LoadAdapter.Response(),
                        'llm_node is unconfigured')
    assert not idle.success and 'unconfigured' in idle.message
    assert list(list_adapters(None, ListAdapters.Response()).adapters) == []


def test_goal_lora_field():
    goal = make_goal('hi', lora={'tools': 1.0, 'site': 0.5})
    assert isinstance(goal, Generate.Goal)
    assert lora_scales(goal.lora) == {'tools': 1.0, 'site': 0.5}
    with pytest.raises(InvalidRequestError, match='twice'):
        lora_scales([LoraScale(name='a', scale=1.0), LoraScale(name='a', scale=2.0)])
    assert LoraScale().scale == 1.0


def test_node_serves_goals_with_adapters(files):  # noqa: F811
    import os

    from llm_node_harness import served_process

    from test_lora_engine import ask, PROMPT
    model, (a1, a2) = files
    eng = engine(files)
    try:
        want = ask(eng, {'one': 1.0, 'two': 0.5})
    finally:
        eng.close()
    params = {'autostart': True, 'model.path': str(model), 'kv.max_context': 128,
              'engine.parallel_sequences': 2, 'lora.adapters': [f'one={a1}', f'two={a2}@0.5'],
              'lora.max_per_goal': 2}
    with served_process('lora_node', params, f'lora_node_client_{os.getpid()}') as (
            proc, client, llm):
        got = llm.generate(PROMPT, raw_prompt=True, max_tokens=12,
                           lora={'one': 1.0, 'two': 0.5}).result(timeout=60)
        assert list(got.token_ids) == want, got.error_message
        bad = llm.generate(PROMPT, raw_prompt=True, max_tokens=4,
                           lora={'nope': 1.0}).result(timeout=60)
        assert bad.error_kind == Generate.Result.ERROR_INVALID_REQUEST
        assert 'unknown adapter' in bad.error_message
        listed = client.call(ListAdapters, '/lora_node/list_adapters', ListAdapters.Request())
        assert [a.name for a in listed.adapters] == ['one', 'two']
        digest = {a.name: a.digest for a in listed.adapters}
        assert all(len(d) == 12 for d in digest.values())
        turn = llm.generate(PROMPT, session_id='s', max_tokens=4,
                            lora={'two': 0.5}).result(timeout=60)
        assert not turn.error_message, turn.error_message
        session = llm.get_session('s', timeout=30)     # ~/get_session lists its adapters
        assert [(u.name, u.scale, u.digest) for u in session.lora] == [
            ('two', 0.5, digest['two'])]
        unloaded = client.call(UnloadAdapter, '/lora_node/unload_adapter',
                               UnloadAdapter.Request(name='two'))
        assert unloaded.success and unloaded.unloaded_now
        again = llm.generate(PROMPT, raw_prompt=True, max_tokens=12,
                             lora={'one': 1.0}).result(timeout=60)
        assert len(again.token_ids) == 12     # serving on
