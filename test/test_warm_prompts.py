"""Warm prompts (kv.warm_prompts) through a real Engine on the tiny model.

A warm prompt is prefilled at init and pinned: a goal whose system message is that prompt
reuses every one of its tokens and answers bit for bit as without it; eviction never takes
it; sessions.store keeps it across a restart without a prefill (decoder calls counted), live
in a slot when configure returns; a stored state of a changed model, converter version or KV
layout is a StoredWarmStateError that the engine reports as the prompt's status while it
prefills the prompt again and serves; each other bad input is a WarmPromptError.
"""
import logging
import shutil
import sqlite3

import pytest
from tiny_model import tiny_model_dir

from edge_llm_msgs.srv import GetModelInfo
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.nodes import llm_services
from edge_llm_ros.runtime.decoder import OnnxDecoder
from edge_llm_ros.runtime.kv_cache import KVCache
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig, kv_budget_bytes
from edge_llm_ros.serving.session_store import KVLayout, model_hash, SessionStore
from edge_llm_ros.serving.warm_prompts import (snapshot_bytes, StoredWarmStateError,
                                               WarmPromptError)

SYSTEM = 'You are a delivery robot in a hospital. Answer in one short sentence.'
OTHER = 'You are a lawn mower. Say what you cut.'


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp('tiny'), accuracy_level=0)


def config(tiny_dir, warm=(), store='', **kw):
    return EngineConfig(model_dir=str(tiny_dir), max_context=256, session_store=str(store),
                        warm_prompts=tuple(warm), **kw)


def ask(engine, question, system=SYSTEM, session=''):
    messages = [ChatMessage('system', system), ChatMessage('user', question)]
    return engine.generate(GenerationRequest(
        messages=messages, max_tokens=8, session_id=session,
        sampling=SamplingConfig(logprobs=True))).run_to_end()


@pytest.fixture
def decoder_calls(monkeypatch):
    """Count every OnnxDecoder.run call (engine init's probe included)."""
    calls = []
    run = OnnxDecoder.run

    def counting(self, rows):
        calls.append(len(rows))
        return run(self, rows)
    monkeypatch.setattr(OnnxDecoder, 'run', counting)
    return calls


def test_a_goal_with_the_warm_system_prompt_reuses_it_bit_for_bit(tiny_dir):
    warm = Engine(config(tiny_dir, [SYSTEM]))
    (prompt,) = warm.warm_prompts()
    question = 'Where is room 4?'
    ids = warm.tokenize(messages=[ChatMessage('system', SYSTEM), ChatMessage('user', question)])
    assert tuple(ids[:prompt.tokens]) == prompt.ids and prompt.tokens < len(ids)
    assert prompt.nbytes == snapshot_bytes(warm.info, prompt.tokens, 'float32')
    got = ask(warm, question)
    other = ask(warm, 'Where is the lift?')   # in the slot the first goal left: still warm
    warm.close()
    cold = Engine(config(tiny_dir))
    want = ask(cold, question)
    cold.close()
    assert got.timings.cached_prompt_tokens == prompt.tokens
    assert other.timings.cached_prompt_tokens >= prompt.tokens
    assert want.timings.cached_prompt_tokens == 0
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_eviction_never_takes_a_warm_prompt(tiny_dir):
    engine = Engine(config(tiny_dir, [SYSTEM], max_sessions=1, session_max_bytes=1))
    (prompt,) = engine.warm_prompts()
    for i in range(4):   # each session evicts the one before; the store holds 1 byte
        ask(engine, f'Go to room {i}.', system=OTHER, session=f's{i}')
    engine.reset_sessions()   # forgets every session and the live caches
    result = ask(engine, 'Where is room 4?')
    engine.close()
    assert result.timings.cached_prompt_tokens == prompt.tokens


def test_two_warm_prompts_and_a_file(tiny_dir, tmp_path):
    path = tmp_path / 'map.txt'
    path.write_text(OTHER)
    engine = Engine(config(tiny_dir, [SYSTEM, f'file:{path}', OTHER]))  # OTHER twice: once
    labels = [p.label for p in engine.warm_prompts()]
    assert labels == [SYSTEM[:40] + '...', f'file:{path}']
    assert ask(engine, 'What now?', system=OTHER).timings.cached_prompt_tokens == \
        engine.warm_prompts()[1].tokens
    info = engine.model_info()['warm_prompts']
    engine.close()
    assert [(w['label'], w['tokens'], w['bytes']) for w in info] == \
        [(p.label, p.tokens, p.nbytes) for p in engine.warm_prompts()]


def test_bad_warm_prompts_fail_init_with_what_to_do(tiny_dir, tmp_path):
    with pytest.raises(WarmPromptError, match='cannot be read.*readable UTF-8 file'):
        Engine(config(tiny_dir, [f'file:{tmp_path}/missing.txt']))
    with pytest.raises(WarmPromptError, match='tokens, and the context holds 256: shorten it '
                                              'or raise kv.max_context'):
        Engine(config(tiny_dir, [SYSTEM * 20]))
    with pytest.raises(WarmPromptError, match='is empty'):
        Engine(config(tiny_dir, ['  ']))
    with pytest.raises(WarmPromptError, match='set kv.prefix_reuse true'):
        Engine(config(tiny_dir, [SYSTEM], prefix_reuse=False))


def test_the_kv_budget_counts_the_warm_prompts(tiny_dir):
    info = load_model_info(str(tiny_dir))
    probe = Engine(config(tiny_dir, [SYSTEM]))
    tokens = probe.warm_prompts()[0].tokens
    probe.close()
    saved = 1 << 16
    fits = kv_budget_bytes(info, 256, 1) + saved + snapshot_bytes(info, tokens, 'float32')
    with pytest.raises(WarmPromptError, match='the warm prompts need .* drop or shorten warm '
                                              'prompts'):
        Engine(config(tiny_dir, [SYSTEM], kv_memory_limit=fits - 1, session_max_bytes=saved))
    engine = Engine(config(tiny_dir, [SYSTEM], kv_memory_limit=fits, session_max_bytes=saved))
    # At run time too: one more does not fit, and the engine keeps serving.
    with pytest.raises(WarmPromptError, match='pinned KV.*shorten it, or raise '
                                              'kv.memory_limit'):
        engine.add_warm_prompt(OTHER)
    assert engine.warm_prompts()[0].tokens == tokens and len(engine.warm_prompts()) == 1
    assert ask(engine, 'Hi?').timings.cached_prompt_tokens == tokens
    engine.close()


def test_a_warm_prompt_added_at_run_time(tiny_dir, tmp_path):
    engine = Engine(config(tiny_dir))
    added = engine.add_warm_prompt(SYSTEM)
    assert engine.add_warm_prompt(SYSTEM) == added   # twice: the same one
    assert ask(engine, 'Hi?').timings.cached_prompt_tokens == added.tokens
    for kwargs, words in (({'path': str(tmp_path / 'no.txt')}, 'cannot be read'),
                          ({'text': SYSTEM * 20}, 'raise kv.max_context'),
                          ({'text': 'x', 'path': 'y'}, 'exactly one of them'),
                          ({}, 'exactly one of them')):
        with pytest.raises(WarmPromptError, match=words):
            engine.add_warm_prompt(**kwargs)
    assert engine.warm_prompts() == [added]
    assert ask(engine, 'Go on.').timings.cached_prompt_tokens == added.tokens
    engine.close()


def test_a_restart_restores_the_warm_prompt_without_a_prefill(tiny_dir, tmp_path,
                                                              decoder_calls, monkeypatch):
    store = tmp_path / 'sessions.db'
    Engine(config(tiny_dir)).close()
    plain = len(decoder_calls)            # engine init alone: the row probe
    first = Engine(config(tiny_dir, [SYSTEM], store))
    prefilled = len(decoder_calls) - plain
    (prompt,) = first.warm_prompts()
    # Written before init returned: the first goals do not share the CPU with the write.
    db = sqlite3.connect(store)
    assert db.execute('SELECT key FROM warm_prompts').fetchall() == [(prompt.key,)]
    db.close()
    want = ask(first, 'Where is room 4?')
    first.close()
    assert prefilled > plain and prompt.status == 'prefilled'
    before = len(decoder_calls)
    second = Engine(config(tiny_dir, [SYSTEM], store))
    assert len(decoder_calls) - before == plain   # no prefill: restored from the store
    (again,) = second.warm_prompts()
    assert (again.ids, again.nbytes, again.restored, prompt.restored) == \
        (prompt.ids, prompt.nbytes, True, False)
    assert again.status == 'restored from sessions.store' and not again.stored_error
    answer = llm_services.model_info(second, GetModelInfo.Response(), 'unloaded')
    assert answer.warm_prompts == [again.label]   # no status beside a label that is fine
    # Live in a slot already: the first goal reuses it there, without a restore copy.
    assert second.kv_occupancy()[0] == prompt.tokens
    restores = []
    monkeypatch.setattr(KVCache, '_restore', lambda *a: restores.append(a))
    result = ask(second, 'Where is room 4?')
    second.close()
    assert result.timings.cached_prompt_tokens == prompt.tokens and restores == []
    assert result.token_ids == want.token_ids
    assert [lp.logprob for lp in result.logprobs] == [lp.logprob for lp in want.logprobs]
    # Without it in kv.warm_prompts, its row goes.
    Engine(config(tiny_dir, [], store)).close()
    db = sqlite3.connect(store)
    assert db.execute('SELECT COUNT(*) FROM warm_prompts').fetchone() == (0,)
    db.close()


def test_another_model_or_converter_prefills_again(tiny_dir, tmp_path, decoder_calls,
                                                   caplog):
    store = tmp_path / 'sessions.db'
    Engine(config(tiny_dir, [SYSTEM], store)).close()
    copy = tmp_path / 'changed'
    shutil.copytree(tiny_dir, copy)
    with open(copy / 'model.yaml', 'a') as f:
        f.write('# another model\n')
    Engine(config(copy)).close()
    for model, edit, words in ((tiny_dir, "converter_version = '0'", 'of converter version 0'),
                               (copy, None, 'of another model')):
        if edit is not None:
            db = sqlite3.connect(store)
            db.execute(f'UPDATE warm_prompts SET {edit}')
            db.commit()
            db.close()
        plain = len(decoder_calls)
        Engine(config(model)).close()
        plain = len(decoder_calls) - plain
        before = len(decoder_calls)
        with caplog.at_level(logging.WARNING):
            engine = Engine(config(model, [SYSTEM], store))
        assert len(decoder_calls) - before > plain   # prefilled again
        assert f'warm prompt {engine.warm_prompts()[0].key}' in caplog.text
        assert words in caplog.text and 'prefilled again' in caplog.text
        # Reported: the typed error is the prompt's status, in model_info too.
        (prompt,) = engine.warm_prompts()
        assert prompt.status.startswith('re-prefilled: StoredWarmStateError: sessions.store ')
        assert words in prompt.status and not prompt.restored
        assert f'model hash {model_hash(str(model))[:16]}' in prompt.stored_error
        assert engine.model_info()['warm_prompts'][0]['status'] == prompt.status
        # ~/get_model_info shows it beside the label.
        answer = llm_services.model_info(engine, GetModelInfo.Response(), 'unloaded')
        assert answer.warm_prompts == [f'{prompt.label} ({prompt.status})']
        result = ask(engine, 'Where is room 4?')   # and it serves, from the new prefill
        engine.close()
        assert result.timings.cached_prompt_tokens == engine.warm_prompts()[0].tokens
        caplog.clear()
    # Saved anew: the next configure restores it.
    engine = Engine(config(copy, [SYSTEM], store))
    (prompt,) = engine.warm_prompts()
    engine.close()
    assert prompt.restored and not prompt.stored_error


def test_a_stored_warm_state_of_another_model_is_a_typed_error(tiny_dir, tmp_path):
    store = tmp_path / 'sessions.db'
    engine = Engine(config(tiny_dir, [SYSTEM], store))
    (prompt,) = engine.warm_prompts()
    engine.close()
    info = load_model_info(str(tiny_dir))
    layout = KVLayout(2 * len(info.kv_layers), info.num_kv_heads, info.head_dim, 'float32',
                      'float32')
    here = model_hash(str(tiny_dir))
    for model_id, kv_layout, words in (
            (here, layout, None),
            ('f' * 64, layout, 'of another model (model hash differs). It was written for '
                               f'model hash {here[:16]} by converter version'),
            (here, KVLayout(layout.buffers, info.num_kv_heads, info.head_dim, 'float32',
                            'int8'), 'of another KV layout or kv.dtype')):
        sink = SessionStore(str(store), model_id, kv_layout)
        try:
            sink.restore_warm(256)
            if words is None:
                assert sink.warm_row(prompt.key).keys == prompt.ids
                continue
            with pytest.raises(StoredWarmStateError) as raised:
                sink.warm_row(prompt.key)
            assert words in str(raised.value) and 'prefilled again' in str(raised.value)
            assert f'this is model hash {model_id[:16]}' in str(raised.value)
            assert isinstance(raised.value, WarmPromptError)
            assert sink.warm_row(prompt.key) is None   # raised once; its row is gone
        finally:
            sink.close()
        engine = Engine(config(tiny_dir, [SYSTEM], store))   # writes it back for model A
        assert engine.warm_prompts()[0].status.startswith('prefilled')
        engine.close()


def test_system_prompt_field_session_goals_and_int8_reuse_it(tiny_dir):
    engine = Engine(config(tiny_dir, [SYSTEM], kv_dtype='int8'))
    (prompt,) = engine.warm_prompts()
    assert prompt.nbytes == snapshot_bytes(engine.info, prompt.tokens, 'int8')
    plain = engine.generate(GenerationRequest(prompt='Where is room 4?', system_prompt=SYSTEM,
                                              max_tokens=4)).run_to_end()
    engine.reset_cache(sessions=False)   # the live caches forget it; the pinned copy stays
    session = ask(engine, 'Go to the lift.', session='robot')
    engine.close()
    assert plain.timings.cached_prompt_tokens == prompt.tokens
    assert session.timings.cached_prompt_tokens == prompt.tokens
