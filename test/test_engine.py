"""Engine, decoder and generator on the tiny converted model, checked against reference.py.

Expected tokens come from the NumPy reference forward pass on the same GGUF (never from the
engine's own output). The tiny model is converted with MatMulNBits accuracy_level=0 (float
math), so the ONNX graph and the reference agree to ~1e-5 and greedy tokens match exactly.
"""
import json
import pathlib
import shutil
import threading

import numpy as np
import pytest
from reference_model import ReferenceModel
from tiny_model import tiny_model_dir
import yaml

from edge_llm_ros.errors import (ContextOverflowError, EngineError, InvalidRequestError,
                                 InvalidSamplingError, InvalidSchemaError, ModelLoadError)
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime.constraint import InvalidGrammarError
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.kv_cache import KVCache
from edge_llm_ros.runtime.request import conversation, InvalidEmbeddingsError, split_chunks
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.runtime.sequence import RECOMPUTE
from edge_llm_ros.runtime.structured import OutputPlan
from edge_llm_ros.runtime.tools.spec import ConstraintConflictError, InvalidToolsError
from edge_llm_ros.runtime.types import (ChatMessage, DeclaredEmbeddings, GenerationRequest,
                                        SamplingConfig, StopReason)
from edge_llm_ros.serving.engine import Engine, EngineConfig

N = 24
PROMPTS = [('once upon a time there was', False), ('robot arm', False),
           ('What color is the sky?', True), ('the blue sky', True)]


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory.mktemp('tiny'), accuracy_level=0)


@pytest.fixture(scope='module')
def ref(tiny_dir) -> ReferenceModel:
    meta = yaml.safe_load((tiny_dir / 'model.yaml').read_text())
    return ReferenceModel.from_gguf(meta['source']['path'])


@pytest.fixture(scope='module')
def engine(tiny_dir):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128, intra_op_threads=1))
    yield eng
    eng.close()


@pytest.fixture
def fresh(engine):
    engine.reset_cache()
    return engine


def prompt_ids(engine, req):
    """Token ids of the request's prompt, through the public tokenize API."""
    if req.use_chat_template:
        return engine.tokenize(messages=conversation(req))
    return engine.tokenize(req.prompt)


def ref_greedy(ref, ids, n, eos, embeds=None):
    """Greedy tokens of the reference, embeddings (if any) ahead of the ids."""
    cache = ref.new_cache()
    logits = ref.forward(ids, cache, embeds=embeds)[-1]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
        logits = ref.forward([tok], cache)[-1]
    return out


def ref_steps(ref, ids, n, bias=None):
    """Greedy tokens of the reference with a logit bias, and each step's log-softmax."""
    cache = ref.new_cache()
    logits = ref.forward(ids, cache)[-1]
    out, logsm = [], []
    for _ in range(n):
        biased = logits.astype(np.float64)
        for token, value in (bias or {}).items():
            biased[token] += value
        tok = int(np.argmax(biased))
        out.append(tok)
        logsm.append(biased - biased.max() - np.log(np.exp(biased - biased.max()).sum()))
        logits = ref.forward([tok], cache)[-1]
    return out, logsm


def run(engine, **kw):
    kw.setdefault('max_tokens', N)
    return engine.generate(GenerationRequest(**kw)).run_to_end()


# --- exact tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize('prompt,chat', PROMPTS)
def test_greedy_tokens_match_reference(fresh, ref, prompt, chat):
    req = GenerationRequest(prompt=prompt, max_tokens=N, use_chat_template=chat)
    expected = ref_greedy(ref, prompt_ids(fresh, req), N, fresh.tokenizer.eos_token_ids)
    events = list(fresh.generate(req))
    result = fresh.generate(req).run_to_end()  # second run: prefix reused
    for got in ([e.token_id for e in events], result.token_ids):
        assert got == expected
    assert [e.index for e in events] == list(range(len(expected)))
    assert result.text == fresh.tokenizer.decode(expected, skip_special_tokens=True)
    assert result.stop_reason == StopReason.LENGTH
    assert result.prompt_tokens == len(prompt_ids(fresh, req))
    assert result.timings.cached_prompt_tokens == result.prompt_tokens - RECOMPUTE


def test_chunked_prefill_matches_reference(tiny_dir, ref):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128, prefill_chunk=3))
    req = GenerationRequest(prompt='What color is the sky?', max_tokens=N)
    expected = ref_greedy(ref, prompt_ids(eng, req), N, eng.tokenizer.eos_token_ids)
    assert eng.generate(req).run_to_end().token_ids == expected


def test_prefill_chunks_never_end_with_a_single_row():
    assert split_chunks(257, 0, 256) == [(0, 255), (255, 257)]
    assert split_chunks(10, 3, 3) == [(3, 6), (6, 8), (8, 10)]
    assert split_chunks(1, 0, 4) == [(0, 1)]
    assert split_chunks(9, 6, 256) == [(6, 9)]


def test_decoder_logits_match_reference(tiny_dir, ref):
    info = load_model_info(str(tiny_dir))
    dec = OnnxDecoder(str(tiny_dir), info, SessionConfig(max_context=64))
    ids = [5, 60, 70, 80, 90, 100, 110, 120]
    want = ref.forward(ids)
    np.testing.assert_allclose(dec.run([Row(0, 0, np.array(ids))])[0], want[-1], atol=2e-4)
    dec.run([Row(0, 0, np.array(ids[:3]))])
    for p in range(3, len(ids)):  # decode steps one position at a time
        got = dec.run([decode_row(0, ids[p], p)])[0]
        np.testing.assert_allclose(got, want[p], atol=2e-4)


def test_decoder_run_refuses_rows_no_call_can_run_and_keeps_serving(tiny_dir, ref):
    info = load_model_info(str(tiny_dir))
    dec = OnnxDecoder(str(tiny_dir), info, SessionConfig(max_context=32, slots=2))
    ids = np.array([5, 60, 70])
    for rows, match in (
            ([], 'at least one row'),
            ([Row(2, 0, ids)], r'slot 2 outside the decoder slots 0\.\.1'),
            ([Row(0, 0, ids), Row(0, 3, ids)], 'two rows of one call name slot 0'),
            ([Row(1, 0, np.zeros(0, np.int64))], 'holds no ids and no embeddings'),
            ([Row(0, 30, ids)], r'positions 30\.\.32 of slot 0 are outside the KV capacity 32'),
            ([Row(0, 0, ids, logits=4)], 'asks logits of 4 of its 3 positions')):
        with pytest.raises(ValueError, match=match):
            dec.run(rows)
    np.testing.assert_allclose(dec.run([Row(1, 0, ids)])[0], ref.forward(list(ids))[-1],
                               atol=2e-4)


# --- rewind / prefix reuse / sessions ---------------------------------------------------------
def test_rewind_gives_identical_logits(tiny_dir):
    info = load_model_info(str(tiny_dir))
    dec = OnnxDecoder(str(tiny_dir), info, SessionConfig(max_context=64))
    cache = KVCache(dec.kv_buffers, dec.capacity)
    prompt = [5, 60, 70, 80, 90, 100]
    logits = dec.run([Row(0, 0, np.array(prompt))])[0]
    cache.append(prompt)
    tokens, seen = [], []
    for _ in range(6):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = dec.run([decode_row(0, tok, cache.length)])[0]
        cache.append_token(tok)
        seen.append(logits.copy())
    cache.rewind_to(len(prompt) + 2)
    for i in range(2, 6):
        again = dec.run([decode_row(0, tokens[i], cache.length)])[0]
        cache.append_token(tokens[i])
        np.testing.assert_array_equal(again, seen[i])
    assert cache.keys == tuple(prompt + tokens)


def test_shared_system_prompt_is_reused_and_identical_to_fresh(fresh, ref):
    system = 'the sky is blue and the robot is in the sky'
    first = run(fresh, system_prompt=system, prompt='Hello')
    req = GenerationRequest(system_prompt=system, prompt='robot arm', max_tokens=N)
    ids = prompt_ids(fresh, req)
    shared = next(i for i, (a, b) in enumerate(zip(ids, prompt_ids(
        fresh, GenerationRequest(system_prompt=system, prompt='Hello')))) if a != b)
    second = fresh.generate(req).run_to_end()
    assert first.completion_tokens == N
    assert second.timings.cached_prompt_tokens == shared
    assert second.timings.prefill_tokens == len(ids) - shared
    assert second.token_ids == ref_greedy(ref, ids, N, fresh.tokenizer.eos_token_ids)
    fresh.reset_cache()
    cold = fresh.generate(req).run_to_end()
    assert cold.timings.cached_prompt_tokens == 0
    assert cold.token_ids == second.token_ids


def conversation_turns(engine, name, questions):
    """Run a multi-turn conversation under session `name`, one turn per call (a generator)."""
    messages = []
    for q in questions:
        messages.append(ChatMessage('user', q))
        req = GenerationRequest(messages=tuple(messages), max_tokens=8, session_id=name)
        result = engine.generate(req).run_to_end()
        yield req, result
        messages.append(ChatMessage('assistant', result.text))


def test_sessions_alternate_without_losing_prefixes(fresh, ref):
    """Each goal resends the whole history, OpenAI style (HISTORY_AUTO continues it)."""
    a = conversation_turns(fresh, 'A', ['the sky', 'robot arm', 'Hello'])
    b = conversation_turns(fresh, 'B', ['What color is it?', 'once upon a time', 'the blue'])
    eos = fresh.tokenizer.eos_token_ids
    previous = {}
    for _ in range(3):
        for name, conv in (('A', a), ('B', b)):
            req, result = next(conv)
            seen = fresh.session(name).conversation.ids   # what the model saw and produced
            ids = list(seen[:len(seen) - len(result.token_ids)])
            assert result.token_ids == ref_greedy(ref, ids, 8, eos)
            if name in previous:
                # The session's previous turn, prompt and answer, came back from its
                # snapshot: the new prompt continues those very ids.
                assert tuple(ids[:len(previous[name])]) == previous[name]
                assert result.timings.cached_prompt_tokens >= len(previous[name]) - 1 - RECOMPUTE
            previous[name] = tuple(seen)
    assert fresh.saved_sessions() == ['A', 'B']  # least recently used first: B ran last


def test_without_sessions_alternating_loses_prefixes(tiny_dir):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128, max_sessions=0))
    a = conversation_turns(eng, '', ['the sky', 'robot arm'])
    b = conversation_turns(eng, '', ['What color is it?', 'once upon a time'])
    a_first = prompt_ids(eng, next(a)[0])
    next(b)
    _, second = next(a)
    assert second.timings.cached_prompt_tokens < len(a_first)
    with pytest.raises(InvalidRequestError, match='keeps no sessions'):
        run(eng, prompt='the sky', session_id='A')


@pytest.mark.parametrize('kv_dtype,tolerance', [('float32', 1e-5), ('int8', 0.02)])
def test_restored_session_logits_close_to_fresh(tiny_dir, kv_dtype, tolerance):
    """int8 snapshots: restored logits within 2 % of the logit range of a fresh prefill."""
    info = load_model_info(str(tiny_dir))
    dec = OnnxDecoder(str(tiny_dir), info, SessionConfig(max_context=64, intra_op_threads=1))
    cache = KVCache(dec.kv_buffers, dec.capacity, kv_dtype, max_sessions=4)
    a = [5, 60, 70, 80, 90, 100, 110, 120, 7, 8, 9, 10]
    tail = [11, 12, 13]
    for keys, session in ((a, 'A'), ([5, 33, 44], 'B')):
        start = cache.plan(keys, session)
        dec.run([Row(0, start, np.array(keys[start:]))])
        cache.append(keys[start:])
    start = cache.plan(a + tail, 'A')
    assert start == len(a)
    restored = dec.run([Row(0, start, np.array(tail))])[0].copy()
    cache.reset()
    fresh = dec.run([Row(0, 0, np.array(a + tail))])[0]
    err = np.abs(restored - fresh).max()
    assert err <= tolerance * np.abs(fresh).max()
    assert int(np.argmax(restored)) == int(np.argmax(fresh))
    if kv_dtype == 'int8':
        assert err > 0  # it really went through int8


def test_prefix_embeddings_match_reference_and_reuse_by_content(fresh, ref):
    hidden = fresh.info.hidden_size
    rng = np.random.default_rng(3)
    e1 = rng.standard_normal((5, hidden)).astype(np.float32)
    e2 = rng.standard_normal((5, hidden)).astype(np.float32)
    eos = fresh.tokenizer.eos_token_ids
    kw = {'prompt': 'robot arm', 'use_chat_template': False, 'max_tokens': 12}
    ids = prompt_ids(fresh, GenerationRequest(**kw))
    r1 = run(fresh, prefix_embeddings=e1, **kw)
    assert r1.prompt_tokens == 5 + len(ids)
    assert r1.token_ids == ref_greedy(ref, ids, 12, eos, embeds=e1)
    r1b = run(fresh, prefix_embeddings=e1.copy(), **kw)
    assert r1b.timings.cached_prompt_tokens == r1.prompt_tokens - RECOMPUTE
    assert r1b.token_ids == r1.token_ids
    r2 = run(fresh, prefix_embeddings=e2, **kw)
    assert r2.timings.cached_prompt_tokens == 0  # other content: nothing reused
    assert r2.token_ids == ref_greedy(ref, ids, 12, eos, embeds=e2)


def test_declared_embeddings_are_checked_at_prepare_and_bound_later(fresh, ref):
    hidden = fresh.info.hidden_size
    e1 = np.random.default_rng(4).standard_normal((3, hidden)).astype(np.float32)
    kw = {'prompt': 'robot arm', 'use_chat_template': False, 'max_tokens': 8}
    ids = prompt_ids(fresh, GenerationRequest(**kw))
    prepared = fresh.prepare(GenerationRequest(
        prefix_embeddings=DeclaredEmbeddings(rows=3, hidden=hidden, dtype='float32'), **kw))
    assert prepared.prompt_ids == tuple(ids) and prepared.prompt_tokens == 3 + len(ids)
    assert not prepared.bound
    with pytest.raises(EngineError, match='never bound'):
        fresh.generate(prepared)
    for wrong in (e1[:2], e1.astype(np.float16), e1.tolist()):
        with pytest.raises(InvalidEmbeddingsError, match='not the declared float32'):
            prepared.bind(wrong)
    with pytest.raises(InvalidEmbeddingsError, match='NaN'):
        prepared.bind(np.full_like(e1, np.inf))
    result = fresh.generate(prepared.bind(e1)).run_to_end()
    assert result.prompt_tokens == 3 + len(ids)
    assert result.token_ids == ref_greedy(ref, ids, 8, fresh.tokenizer.eos_token_ids, embeds=e1)
    # The same array given directly is prepared and bound in one call: same run.
    assert run(fresh, prefix_embeddings=e1, **kw).token_ids == result.token_ids


@pytest.mark.parametrize('declared,error,match', [
    (DeclaredEmbeddings(rows=2, hidden=64, dtype='uint8'), InvalidEmbeddingsError, 'dtype'),
    (DeclaredEmbeddings(rows=2, hidden=65, dtype='float32'), InvalidEmbeddingsError, 'shape'),
    # Rows checked from the declared shape alone: nothing of that size is allocated.
    (DeclaredEmbeddings(rows=1 << 40, hidden=64, dtype='float32'), ContextOverflowError,
     '1099511627776 rows'),
    (DeclaredEmbeddings(rows=100, hidden=64, dtype='float32'), ContextOverflowError,
     'shorten the prompt'),
])
def test_declared_embeddings_are_refused_by_shape(engine, declared, error, match):
    with pytest.raises(error, match=match):
        engine.prepare(GenerationRequest(prompt='robot arm', max_tokens=20,
                                         prefix_embeddings=declared))


# --- stopping -------------------------------------------------------------------------------
def test_max_tokens(fresh, ref):
    req = GenerationRequest(prompt='robot arm', use_chat_template=False, max_tokens=5)
    result = fresh.generate(req).run_to_end()
    assert result.completion_tokens == 5 and result.stop_reason == StopReason.LENGTH
    assert result.token_ids == ref_greedy(ref, prompt_ids(fresh, req), 5, ())


def test_eos_stops_with_stop_reason(tiny_dir, ref, tmp_path):
    # Make a token the reference produces mid-way this model's EOS (model.yaml is the source of
    # truth for both the runtime and the tokenizer).
    probe = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128))
    req = GenerationRequest(prompt='once upon a time there was', use_chat_template=False,
                            max_tokens=N)
    expected = ref_greedy(ref, prompt_ids(probe, req), N, ())
    k = next(i for i, t in enumerate(expected) if i > 0 and t not in expected[:i])
    model = tmp_path / 'model'
    shutil.copytree(tiny_dir, model)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    meta['eos_token_ids'] = [expected[k]]
    (model / 'model.yaml').write_text(yaml.safe_dump(meta))
    eng = Engine(EngineConfig(model_dir=str(model), max_context=128))
    gen = eng.generate(req)
    events = list(gen)
    result = gen.result
    assert [e.token_id for e in events] == expected[:k + 1]
    assert result.stop_reason == StopReason.STOP
    text = eng.tokenizer.decode(expected[:k], skip_special_tokens=True)
    assert ''.join(e.text_delta for e in events) == text == result.text


def test_stop_string_across_tokens(fresh, ref):
    req = GenerationRequest(prompt='once upon a time there was', use_chat_template=False,
                            max_tokens=N)
    expected = ref_greedy(ref, prompt_ids(fresh, req), N, ())
    full = fresh.tokenizer.decode(expected)
    # A stop string that starts inside one token's text and ends in the next one.
    cut = len(fresh.tokenizer.decode(expected[:8]))
    stop = full[cut - 1:cut + 1]
    req.stop = (stop,)
    result = fresh.generate(req).run_to_end()
    assert result.stop_reason == StopReason.STOP
    assert result.text == full[:full.index(stop)]
    assert result.token_ids == expected[:len(result.token_ids)]
    assert result.completion_tokens < N


def test_json_schema_constrains_random_model(fresh):
    schema = {'type': 'object', 'properties': {'turn': {'enum': ['left', 'right']}},
              'required': ['turn'], 'additionalProperties': False}
    result = run(fresh, prompt='robot arm', json_schema=json.dumps(schema), max_tokens=40)
    assert result.stop_reason == StopReason.STOP
    assert json.loads(result.text)['turn'] in ('left', 'right')


def test_seeded_sampling_repeats(fresh):
    kw = {'prompt': 'the blue sky', 'sampling': SamplingConfig(temperature=1.5, seed=11)}
    first = run(fresh, **kw)
    fresh.reset_cache()
    assert run(fresh, **kw).token_ids == first.token_ids


# --- cancel / errors / concurrency -------------------------------------------------------------
def test_cancel_between_steps_stops_at_the_next_step(fresh):
    gen = fresh.generate(GenerationRequest(prompt='robot arm', max_tokens=N))
    got = []
    for event in gen:
        got.append(event)
        if event.index == 3:
            t = threading.Thread(target=gen.cancel)
            t.start()
            t.join()
    assert len(got) == 4
    assert gen.result.stop_reason == StopReason.CANCELLED
    assert gen.result.completion_tokens == 4


def test_cancel_during_a_step_stops_within_one_step(fresh):
    step_started = threading.Event()
    release = threading.Event()
    run_rows = fresh._decoder.run

    def slow_decode(rows):
        if all(row.decode_step for row in rows):
            step_started.set()
            release.wait(5)
        return run_rows(rows)

    gen = fresh.generate(GenerationRequest(prompt='robot arm', max_tokens=N))
    got = []
    fresh._decoder.run = slow_decode
    try:
        consumer = threading.Thread(target=lambda: got.extend(gen))
        consumer.start()
        assert step_started.wait(5)  # the consumer is inside a decode step now
        gen.cancel()
        release.set()
        consumer.join(10)
    finally:
        del fresh._decoder.run
    assert not consumer.is_alive()
    assert gen.result.stop_reason == StopReason.CANCELLED
    assert len(got) <= 2  # the first token, and at most the step that was running


def test_cancel_before_iterating(fresh):
    gen = fresh.generate(GenerationRequest(prompt='robot arm', max_tokens=N))
    gen.cancel()
    assert list(gen) == []
    assert gen.result.stop_reason == StopReason.CANCELLED
    assert gen.result.timings.prefill_tokens == 0


def test_cancel_during_chunked_prefill_keeps_the_cache_consistent(tiny_dir, ref):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128, prefill_chunk=4))
    req = GenerationRequest(prompt='once upon a time there was', max_tokens=6)
    run_rows = eng._decoder.run
    gen = eng.generate(req)

    def cancelling_forward(rows):
        gen.cancel()  # arrives while the first chunk runs
        return run_rows(rows)

    eng._decoder.run = cancelling_forward
    try:
        assert list(gen) == []
    finally:
        del eng._decoder.run
    assert gen.result.stop_reason == StopReason.CANCELLED
    assert eng.kv_occupancy()[0] == 4  # only the chunk that ran is committed
    result = eng.generate(req).run_to_end()
    assert result.timings.cached_prompt_tokens == 4
    assert result.token_ids == ref_greedy(ref, prompt_ids(eng, req), 6,
                                          eng.tokenizer.eos_token_ids)


def test_prefix_reuse_off(tiny_dir):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64, prefix_reuse=False))
    req = GenerationRequest(prompt='robot arm', max_tokens=4)
    first = eng.generate(req).run_to_end()
    second = eng.generate(req).run_to_end()
    assert second.timings.cached_prompt_tokens == 0
    assert second.token_ids == first.token_ids
    assert eng.saved_sessions() == []
    with pytest.raises(InvalidRequestError, match='keeps no sessions'):
        run(eng, prompt='robot arm', session_id='A')


def test_closed_engine_refuses_requests(tiny_dir):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64))
    eng.close()
    with pytest.raises(EngineError, match='closed'):
        eng.generate(GenerationRequest(prompt='hi', max_tokens=2))


def test_runtime_error_ends_with_error_not_exception(fresh, ref):
    run_rows = fresh._decoder.run

    def broken(rows):
        if all(row.decode_step for row in rows):
            raise RuntimeError('simulated device failure')
        return run_rows(rows)

    fresh._decoder.run = broken
    try:
        gen = fresh.generate(GenerationRequest(prompt='robot arm', max_tokens=N))
        events = list(gen)
    finally:
        del fresh._decoder.run
    assert len(events) == 1  # the first token comes from the prefill
    assert gen.result.stop_reason == StopReason.ERROR
    assert 'simulated device failure' in gen.result.error
    req = GenerationRequest(prompt='robot arm', max_tokens=5)  # the engine still works
    assert fresh.generate(req).run_to_end().token_ids == ref_greedy(
        ref, prompt_ids(fresh, req), 5, fresh.tokenizer.eos_token_ids)


def test_keyboard_interrupt_propagates_and_ends_as_cancelled(fresh):
    run_rows = fresh._decoder.run

    def interrupted(rows):
        if all(row.decode_step for row in rows):
            raise KeyboardInterrupt
        return run_rows(rows)

    fresh._decoder.run = interrupted
    gen = fresh.generate(GenerationRequest(prompt='robot arm', max_tokens=N))
    try:
        with pytest.raises(KeyboardInterrupt):
            list(gen)
    finally:
        del fresh._decoder.run
    assert gen.result.stop_reason == StopReason.CANCELLED
    assert gen.result.completion_tokens == 1
    assert list(gen) == []


def test_new_generation_abandons_unfinished_one(fresh, ref):
    first = fresh.generate(GenerationRequest(prompt='the sky', max_tokens=N))
    next(first)
    req = GenerationRequest(prompt='robot arm', use_chat_template=False, max_tokens=10)
    second = fresh.generate(req).run_to_end()
    assert first.result.stop_reason == StopReason.CANCELLED
    assert list(first) == []
    assert second.token_ids == ref_greedy(ref, prompt_ids(fresh, req), 10, ())


def test_timings_and_occupancy(fresh):
    result = run(fresh, prompt='robot arm', max_tokens=6)
    t = result.timings
    assert t.prefill_tokens + t.cached_prompt_tokens == result.prompt_tokens
    assert 0 < t.time_to_first_token_s <= t.total_s
    assert t.prefill_tokens_per_second > 0 and t.decode_tokens_per_second > 0
    # The last generated token is sampled but never fed back.
    assert fresh.kv_occupancy() == (result.prompt_tokens + 5, 128)


# --- new request fields --------------------------------------------------------------------
def test_new_fields_at_their_defaults_change_nothing(fresh, ref):
    """A request spelling out every new field's default runs the plain path, same tokens."""
    req = GenerationRequest(prompt='the blue sky', max_tokens=N)
    explicit = GenerationRequest(
        prompt='the blue sky', max_tokens=N, tools=(), tool_choice='none',
        parallel_tool_calls=True, grammar='', regex='', choices=(), reasoning=True,
        reasoning_budget=None, sampling=SamplingConfig(logit_bias={}, frequency_penalty=0.0,
                                                       logprobs=False, top_logprobs=0))
    expected = ref_greedy(ref, prompt_ids(fresh, req), N, fresh.tokenizer.eos_token_ids)
    for request in (req, explicit):
        prepared = fresh.prepare(request)
        assert prepared.output == OutputPlan() and prepared.constraint is None
        assert list(prepared.prompt_ids) == prompt_ids(fresh, req)  # the template as before
        events = list(fresh.generate(prepared))
        assert [e.token_id for e in events] == expected
        assert all(e.reasoning_delta == '' and e.tool_call_deltas == () and e.logprobs is None
                   for e in events)


def test_logit_bias_and_logprobs_match_reference(fresh, ref):
    req = GenerationRequest(prompt='robot arm', use_chat_template=False, max_tokens=10)
    ids = prompt_ids(fresh, req)
    plain, _ = ref_steps(ref, ids, 10)
    # Ban the greedy first token and push another one up: the reference, biased, agrees.
    bias = {plain[0]: -100.0, plain[3]: 4.0}
    expected, logsm = ref_steps(ref, ids, 10, bias)
    req.sampling = SamplingConfig(logit_bias=bias, logprobs=True, top_logprobs=3)
    result = fresh.generate(req).run_to_end()
    assert result.token_ids == expected and plain[0] not in expected
    for token, lp, ls in zip(expected, result.logprobs, logsm):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ls[token], abs=1e-3)
        best = np.argsort(-ls)[:3]
        assert [t for t, _ in lp.top] == [int(t) for t in best]
        assert [v for _, v in lp.top] == pytest.approx([ls[t] for t in best], abs=1e-3)


def test_choices_constrain_the_random_model(fresh):
    result = run(fresh, prompt='robot arm', choices=['left', 'right', 'stop'], max_tokens=10)
    assert result.text in ('left', 'right', 'stop') and result.stop_reason == StopReason.STOP


# --- engine services -------------------------------------------------------------------------
def test_detokenize(fresh):
    ids = fresh.tokenize('the blue sky')
    assert fresh.detokenize(ids) == 'the blue sky'
    assert fresh.detokenize(np.array(ids)) == 'the blue sky'
    eos = fresh.tokenizer.eos_token_ids[0]
    assert fresh.detokenize([eos]) and fresh.detokenize([eos], skip_special_tokens=True) == ''
    with pytest.raises(InvalidRequestError, match='outside the vocabulary'):
        fresh.detokenize([fresh.tokenizer.vocab_size])
    with pytest.raises(InvalidRequestError, match='integers'):
        fresh.detokenize([1.5])


def test_reset_sessions(fresh):
    def turn(session, prompt):
        return run(fresh, prompt=prompt, max_tokens=2, session_id=session)

    alone = turn('', 'once upon a time there was a').prompt_tokens   # a first turn's prompt
    fresh.reset_cache()
    turn('A', 'once upon a time there was')
    turn('B', 'robot arm')  # A's prefix is saved as B overwrites the live cache
    assert fresh.saved_sessions() == ['A']
    assert turn('A', 'once upon a time there was a').timings.cached_prompt_tokens > 4
    turn('B', 'robot arm')  # and B's as A came back
    assert fresh.saved_sessions() == ['A', 'B']
    assert fresh.reset_sessions('A') == 1 and fresh.saved_sessions() == ['B']
    assert fresh.session('A') is None
    # Gone: A starts again, its prompt is a first turn's.
    assert turn('A', 'once upon a time there was a').prompt_tokens == alone
    assert fresh.reset_sessions('nobody') == 0  # unknown: a documented no-op
    assert fresh.reset_sessions('A') == 1  # the live cache was A's
    assert fresh.kv_occupancy()[0] == 0
    turn('A', 'robot arm')
    turn('B', 'the blue sky')
    assert fresh.reset_sessions() == 2
    assert fresh.saved_sessions() == [] and fresh.kv_occupancy()[0] == 0
    assert fresh.sessions() == []
    with pytest.raises(InvalidRequestError, match='session_id'):
        fresh.reset_sessions(None)


def test_model_info(engine):
    info = engine.model_info()
    assert info['architecture'] == 'llama' and info['vocab_size'] == engine.vocab_size
    assert info['context_length'] == 128 and info['chat_template'].startswith('{%')
    assert info['family'] == 'llama3' and info['family_error'] == ''  # llama's fallback
    assert info['capabilities'] == {'tools': True, 'reasoning': False,
                                    'reasoning_can_disable': False, 'embeddings_input': True,
                                    'vision': False}
    assert set(info) >= {'quantization', 'model_name', 'tool_call_format'}


def test_model_family_override_and_unknown_family(tiny_dir, tmp_path):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64, model_family='qwen3'))
    assert eng.family.family == 'qwen3' and eng.model_info()['capabilities']['reasoning']
    # A family's stop tokens end a turn too (a family file given by path).
    (tmp_path / 'stopper.yaml').write_text(
        "family: stopper\narchitectures: [llama]\nstop_tokens: ['<|im_start|>']\n")
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64,
                              model_family=str(tmp_path / 'stopper.yaml')))
    start = eng.tokenize('<|im_start|>')
    assert len(start) == 1 and start[0] not in eng.tokenizer.eos_token_ids
    req = GenerationRequest(prompt='robot arm', max_tokens=3, sampling=SamplingConfig(
        logit_bias={start[0]: 100.0}))
    result = eng.generate(req).run_to_end()
    assert (result.token_ids, result.stop_reason) == (start, StopReason.STOP)
    plain = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64))  # llama3: not listed
    assert plain.generate(req).run_to_end().stop_reason == StopReason.LENGTH
    with pytest.raises(ModelLoadError, match="unknown model family 'nosuch'"):
        Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64, model_family='nosuch'))
    model = tmp_path / 'model'
    shutil.copytree(tiny_dir, model)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    meta['family'] = 'nosuch'
    (model / 'model.yaml').write_text(yaml.safe_dump(meta))
    eng = Engine(EngineConfig(model_dir=str(model), max_context=64))
    assert eng.family is None and 'nosuch' in eng.model_info()['family_error']
    result = eng.generate(GenerationRequest(prompt='robot arm', max_tokens=3)).run_to_end()
    assert result.completion_tokens == 3  # no family: still serves, generic JSON tool calls


# --- bad input ------------------------------------------------------------------------------
def options(**kwargs):
    return kwargs


TOOL = {'type': 'function', 'function': {'name': 'dock', 'parameters': {
    'type': 'object', 'properties': {'station': {'enum': ['a', 'b']}}}}}


BAD_REQUESTS = [
    (options(prompt=''), InvalidRequestError, 'empty'),
    (options(prompt='', system_prompt='only a system prompt'), InvalidRequestError, 'empty'),
    (options(messages=(ChatMessage('robot', 'hi'),)), InvalidRequestError, 'role'),
    (options(prompt='hi', max_tokens=0), InvalidRequestError, 'max_tokens'),
    (options(prompt='hi', max_tokens=128), ContextOverflowError, 'max_tokens'),
    (options(prompt='hi', max_tokens=2.5), InvalidRequestError, 'integer'),
    (options(prompt='hi', sampling=SamplingConfig(temperature=-1.0)), InvalidSamplingError,
     'temperature'),
    (options(prompt='hi', sampling=SamplingConfig(top_p=0.0)), InvalidSamplingError, 'top_p'),
    (options(prompt='hi', sampling=SamplingConfig(top_k=-2)), InvalidSamplingError, 'top_k'),
    (options(prompt='hi', json_schema='{not json'), InvalidSchemaError, 'JSON'),
    (options(prompt='hi', json_schema='{"type": "nonsense"}'), InvalidSchemaError, 'schema'),
    (options(prompt='hi', stop=('',)), InvalidRequestError, 'stop'),
    (options(prompt='hi', prefix_embeddings=np.zeros((2, 64), np.int32)), InvalidEmbeddingsError,
     'dtype'),
    (options(prompt='hi', prefix_embeddings=np.zeros((2, 65), np.float32)),
     InvalidEmbeddingsError, 'shape'),
    (options(prompt='hi', prefix_embeddings=np.full((2, 64), np.nan, np.float32)),
     InvalidEmbeddingsError, 'NaN'),
    (options(prompt='hi', prefix_embeddings=[[0.0] * 64]), InvalidEmbeddingsError, 'numpy'),
    (options(prompt='hi', messages=(ChatMessage('user', 'x'),), use_chat_template=False),
     InvalidRequestError, 'chat template'),
    (options(prompt='hi', session_id=3), InvalidRequestError, 'session_id'),
    (options(prompt='word ' * 200), ContextOverflowError, 'shorten the prompt'),
    (options(prompt='hi', tools=[TOOL], json_schema='{}'), ConstraintConflictError,
     'tools and json_schema'),
    (options(prompt='hi', regex='a', choices=['a']), ConstraintConflictError, 'regex and choices'),
    (options(prompt='hi', use_chat_template=False, regex='a', json_schema='{}'),
     ConstraintConflictError, 'json_schema and regex'),
    (options(prompt='hi', tools=[TOOL], tool_choice='fly'), InvalidToolsError,
     "unknown tool 'fly'"),
    (options(prompt='hi', tool_choice='required'), InvalidToolsError, 'needs tools'),
    (options(prompt='hi', tools=[{'name': 'f', 'parameters': {'type': 'x'}}]), InvalidToolsError,
     'invalid'),
    (options(prompt='hi', tools='dock'), InvalidRequestError, 'tools must be a list'),
    (options(prompt='hi', grammar='start: ('), InvalidGrammarError, 'does not compile'),
    (options(prompt='hi', regex='(unclosed'), InvalidGrammarError, 'does not compile'),
    (options(prompt='hi', choices='yes'), InvalidRequestError, 'choices must be a list'),
    (options(prompt='hi', choices=['a', 'a']), InvalidGrammarError, 'distinct'),
    (options(prompt='hi', sampling=SamplingConfig(logit_bias={10 ** 6: 1.0})),
     InvalidSamplingError, 'outside the vocabulary'),
    (options(prompt='hi', sampling=SamplingConfig(logit_bias={5: 101.0})), InvalidSamplingError,
     'logit_bias'),
    (options(prompt='hi', sampling=SamplingConfig(top_logprobs=21)), InvalidSamplingError,
     'top_logprobs'),
    (options(prompt='hi', sampling=SamplingConfig(frequency_penalty=3.0)), InvalidSamplingError,
     'frequency_penalty'),
    (options(prompt='hi', reasoning_budget=5), InvalidRequestError, 'no reasoning tags'),
    (options(prompt='hi', reasoning='no'), InvalidRequestError, 'reasoning must be true'),
    (options(prompt='hi', parallel_tool_calls=1), InvalidRequestError, 'parallel_tool_calls'),
    (options(prompt='hi', use_chat_template=False, tools=[TOOL]), InvalidRequestError,
     'tools need the chat template'),
    (options(prompt='hi', use_chat_template=False, reasoning_budget=3), InvalidRequestError,
     'need the chat template'),
]


@pytest.mark.parametrize('kw,error,match', BAD_REQUESTS)
def test_bad_requests_raise_typed_errors(engine, kw, error, match):
    req = GenerationRequest(**{'max_tokens': 8, **kw})
    with pytest.raises(error, match=match):
        engine.prepare(req)
    with pytest.raises(error, match=match):
        engine.generate(req)


def test_context_overflow_message_names_the_numbers(engine):
    req = GenerationRequest(prompt='robot arm', max_tokens=120)
    n = len(prompt_ids(engine, GenerationRequest(prompt='robot arm')))
    with pytest.raises(ContextOverflowError) as info:
        engine.prepare(req)
    assert f'prompt {n} tokens + max_tokens 120 > context 128' in str(info.value)


def test_model_load_errors(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match='does not exist'):
        Engine(EngineConfig(model_dir=str(tmp_path / 'nowhere')))
    broken = tmp_path / 'broken'
    shutil.copytree(tiny_dir, broken)
    (broken / 'model.onnx').write_bytes(b'not a model')
    with pytest.raises(ModelLoadError, match='model.onnx.*edge-llm-convert'):
        Engine(EngineConfig(model_dir=str(broken), max_context=64))
    (broken / 'model.yaml').unlink()
    with pytest.raises(ModelLoadError, match='model.yaml is missing.*edge-llm-convert'):
        Engine(EngineConfig(model_dir=str(broken)))
    (broken / 'model.yaml').write_text('name: [unclosed')
    with pytest.raises(ModelLoadError, match='model.yaml is unreadable'):
        Engine(EngineConfig(model_dir=str(broken)))


@pytest.mark.parametrize('config,match', [
    (options(providers=('NoSuchExecutionProvider',)), 'available: .*CPUExecutionProvider'),
    (options(providers=('CPUExecutionProvider',), provider_options=({}, {})), 'one dict'),
    (options(intra_op_threads=2, intra_op_affinity='1;2'), '2 threads need 1'),
    (options(intra_op_threads=0, intra_op_affinity='1'), 'intra_op_threads >= 2'),
    (options(max_context=100000), 'max_position_embeddings'),
    (options(kv_dtype='int4'), 'kv_dtype'),
])
def test_bad_engine_config(tiny_dir, config, match):
    with pytest.raises(ModelLoadError, match=match):
        Engine(EngineConfig(model_dir=str(tiny_dir), **{'max_context': 64, **config}))


def test_thread_settings_apply(tiny_dir, ref):
    eng = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64, intra_op_threads=2,
                              intra_op_affinity='1'))
    req = GenerationRequest(prompt='robot arm', max_tokens=6)
    assert eng.generate(req).run_to_end().token_ids == ref_greedy(
        ref, prompt_ids(eng, req), 6, eng.tokenizer.eos_token_ids)
