"""Continuous batching on the tiny converted model: policy, cancel, exactness, KV budget.

The scheduler is stepped by hand here, so every interleaving is deterministic. The tiny model
is converted at MatMulNBits accuracy_level 0 (float math); expected tokens come from the NumPy
reference forward pass (reference.py), never from the engine itself.
"""
from dataclasses import dataclass
import pathlib
import shutil
from typing import Optional

from compat_matrix import TINY_TYPES
import numpy as np
import onnx
import pytest
import test_engine
from tiny_model import tiny_model_dir

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.runtime.sequence import RECOMPUTE
from edge_llm_ros.runtime.types import GenerationRequest, GenerationResult, StopReason, TokenEvent
from edge_llm_ros.serving.engine import Engine, EngineConfig, kv_budget_bytes
from edge_llm_ros.serving.executor import probe_rows
from edge_llm_ros.serving.goal import Goal, GoalState as SeqState, LIVE, PRIORITY_MAX, PRIORITY_MIN
from edge_llm_ros.serving.queue import WaitQueue

# Fixtures: the tiny model (accuracy level 0) and its NumPy reference, as test_engine has them.
tiny_dir = test_engine.tiny_dir
ref = test_engine.ref
PROMPTS = ('once upon a time there was', 'robot arm', 'What color is the sky?', 'the blue sky',
           'Hello the sky is blue', 'a b c d e f g')


def make_engine(tiny_dir, n, **kw):
    kw.setdefault('max_context', 96)
    return Engine(EngineConfig(model_dir=str(tiny_dir), intra_op_threads=1,
                               parallel_sequences=n, **kw))


@pytest.fixture(scope='module')
def eng4(tiny_dir):
    eng = make_engine(tiny_dir, 4)
    yield eng
    eng.close()


@pytest.fixture(scope='module')
def eng2(tiny_dir):
    eng = make_engine(tiny_dir, 2, prefill_chunk=4)
    yield eng
    eng.close()


def seq(eng, prompt, max_tokens=12, priority=0, preempt=False, **kw):
    # The prompt's ids are eng.tokenize(prompt); a session keeps a chat conversation.
    kw.setdefault('use_chat_template', bool(kw.get('session_id')))
    return Goal(eng.prepare(GenerationRequest(prompt=prompt, max_tokens=max_tokens, **kw)),
                priority=priority, preempt=preempt)


@dataclass(frozen=True)
class Event:
    """One thing a plan did to one goal, in the order the reports list them."""

    seq: Goal
    token: Optional[TokenEvent] = None
    paused: Optional[bool] = None
    result: Optional[GenerationResult] = None


def events_of(report):
    events = [Event(g, paused=True) for g in report.paused]
    events += [Event(g, paused=False) for g in report.resumed]
    events += [Event(g, token=g.output.events[-1]) for g in report.tokens]
    return events + [Event(g, result=g.result) for g in report.ended]


class Stepper:
    """The engine's scheduler, stepped by hand: step() runs one plan (one model call)."""

    def __init__(self, eng):
        self._eng = eng
        self._sched = eng.scheduler()

    def __getattr__(self, name):
        return getattr(self._sched, name)

    def step(self):
        return events_of(self._eng.run_plan())


def stepper(eng):
    return Stepper(eng)


def drain(sched, limit=5000):
    """Step until nothing is left; return every event."""
    events = []
    for _ in range(limit):
        if sched.idle():
            return events
        events += sched.step()
    raise AssertionError('the scheduler did not drain')


def step_until(sched, predicate, limit=500):
    events = []
    for _ in range(limit):
        if predicate():
            return events
        events += sched.step()
    raise AssertionError('condition not reached')


def results_of(events):
    return {id(e.seq): e.result for e in events if e.result is not None}


# --- exactness -------------------------------------------------------------------------------
def test_batch_of_four_matches_the_reference_token_for_token(eng4, ref):
    sched = stepper(eng4)
    eng4.reset_cache()
    seqs = [sched.submit(seq(eng4, p, max_tokens=16)) for p in PROMPTS[:4]]
    events = drain(sched)
    eos = eng4.tokenizer.eos_token_ids
    for s, prompt in zip(seqs, PROMPTS):
        want = ref.greedy(eng4.tokenize(prompt), 16, eos)
        assert s.result.token_ids == want, prompt
        streamed = [e.token.token_id for e in events if e.seq is s and e.token is not None]
        assert streamed == want
    # The four decoded together: some step carried a token of every one of them.
    assert len({id(e.seq) for e in events if e.token is not None}) == 4


def test_alone_and_in_a_batch_are_bit_identical(eng4, compat):
    """A sequence alone on an N>1 engine runs >= 2 rows, like in any batch (MIN_ROWS)."""
    compat('llama', TINY_TYPES, 'batching')
    sched = stepper(eng4)
    prompt = PROMPTS[0]

    def logprob_run(others):
        eng4.reset_cache()
        s = sched.submit(seq(eng4, prompt, max_tokens=10, sampling=_greedy_logprobs()))
        for p in others:
            sched.submit(seq(eng4, p, max_tokens=10))
        drain(sched)
        return [lp.logprob for lp in s.result.logprobs], s.result.token_ids
    alone = logprob_run([])
    batched = logprob_run(PROMPTS[1:4])
    assert alone == batched


def test_mixed_requests_in_a_batch_equal_each_alone(eng4, tiny_dir):
    """Stop strings, constraints, sampling, logprobs and embeddings stay per sequence.

    Each result equals the same request run alone (solo Engine.generate).
    """
    import json
    from edge_llm_ros.runtime.types import SamplingConfig
    schema = {'type': 'object', 'properties': {'turn': {'enum': ['left', 'right']}},
              'required': ['turn'], 'additionalProperties': False}
    embeds = np.random.default_rng(3).standard_normal((5, eng4.info.hidden_size))
    base = {'prompt': 'robot arm', 'use_chat_template': False, 'max_tokens': 20}
    requests = [
        GenerationRequest(**base, json_schema=json.dumps(schema)),
        GenerationRequest(**dict(base, prompt='the blue sky'),
                          sampling=SamplingConfig(temperature=1.5, seed=11)),
        GenerationRequest(**dict(base, prompt='once upon a time there was'),
                          sampling=SamplingConfig(logprobs=True, top_logprobs=2)),
        GenerationRequest(**base, prefix_embeddings=embeds.astype(np.float32)),
    ]
    alone = make_engine(tiny_dir, 1)
    try:
        want = [alone.generate(r).run_to_end() for r in requests]
        text = want[2].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        requests.append(GenerationRequest(**dict(base, prompt='once upon a time there was'),
                                          stop=[stop]))
        want.append(alone.generate(requests[-1]).run_to_end())
    finally:
        alone.close()
    sched = stepper(eng4)
    eng4.reset_cache()
    seqs = [sched.submit(Goal(eng4.prepare(r))) for r in requests]
    drain(sched)
    assert want[4].stop_reason is StopReason.STOP and stop not in want[4].text
    assert json.loads(want[0].text)['turn'] in ('left', 'right')
    for s, w in zip(seqs, want):
        got = s.result
        assert (got.token_ids, got.text, got.stop_reason) == (w.token_ids, w.text,
                                                              w.stop_reason)
        assert [[t for t, _ in lp.top] for lp in got.logprobs] == \
            [[t for t, _ in lp.top] for lp in w.logprobs]
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs],
                                   [lp.logprob for lp in w.logprobs], atol=1e-4)
        assert got.prompt_tokens == w.prompt_tokens and got.timings.prefill_tokens > 0


def _greedy_logprobs():
    from edge_llm_ros.runtime.types import SamplingConfig
    return SamplingConfig(temperature=0.0, logprobs=True, top_logprobs=0)


# --- policy ----------------------------------------------------------------------------------
def test_wait_queue_orders_by_priority_then_arrival():
    q = WaitQueue()
    items = []
    for i, p in enumerate((0, 5, 0, 5, -3, 100)):
        s = Goal(None, priority=p)
        s.arrival = i
        q.push(s)
        items.append(s)
    assert q.items() == [items[5], items[1], items[3], items[0], items[2], items[4]]


def test_priority_range_is_checked(eng2):
    sched = stepper(eng2)
    for bad in (PRIORITY_MIN - 1, PRIORITY_MAX + 1, 1.5, True):
        with pytest.raises(ValueError, match='priority'):
            sched.submit(seq(eng2, 'hi', priority=bad))
    assert sched.idle()


def test_admission_order_and_interleaved_prefill(eng2):
    sched = stepper(eng2)
    eng2.reset_cache()
    a = sched.submit(seq(eng2, PROMPTS[0], max_tokens=30))
    b = sched.submit(seq(eng2, 'robot', max_tokens=30))
    step_until(sched, lambda: a.state is SeqState.DECODE and b.state is SeqState.DECODE)
    low = sched.submit(seq(eng2, 'x', priority=-1))
    first = sched.submit(seq(eng2, 'y', priority=3))
    second = sched.submit(seq(eng2, 'z', priority=3))
    tie = sched.submit(seq(eng2, 'w'))
    assert sched.waiting() == [first, second, tie, low]
    sched.cancel(b)   # frees a slot: the head (priority 3, first arrival) takes it
    sched.step()
    assert first.state in LIVE and sched.waiting() == [second, tie, low]
    # A long prompt prefills in chunks of 4 while `a` keeps decoding: one chunk per step.
    long_prompt = ' '.join(['the sky is blue'] * 6)
    sched.cancel(first)
    sched.step()
    assert second.state in LIVE
    sched.cancel(second)
    sched.step()
    sched.cancel(tie)
    sched.cancel(low)
    slow = sched.submit(seq(eng2, long_prompt, max_tokens=3))
    tokens_of_a = 0
    steps = 0
    while slow.state in (SeqState.WAITING, SeqState.PREFILL) and steps < 200:
        events = sched.step()
        steps += 1
        tokens_of_a += sum(1 for e in events if e.seq is a and e.token is not None)
        assert sum(1 for e in events if e.seq is a and e.token is not None) <= 1
    assert steps >= 5 and tokens_of_a >= steps - 2   # `a` got a token in (nearly) every step
    drain(sched)
    assert a.result.stop_reason is StopReason.LENGTH and a.result.completion_tokens == 30
    assert slow.result.completion_tokens == 3


def test_preempt_pauses_the_lowest_latest_and_resumes_it_exactly(eng2, ref):
    sched = stepper(eng2)
    eng2.reset_cache()
    eos = eng2.tokenizer.eos_token_ids
    low = sched.submit(seq(eng2, PROMPTS[0], max_tokens=20, priority=0))
    later = sched.submit(seq(eng2, PROMPTS[1], max_tokens=20, priority=0))
    step_until(sched, lambda: len(later.output) >= 3)
    waiting_same = sched.submit(seq(eng2, 'hello', max_tokens=4, priority=0))
    urgent = sched.submit(seq(eng2, PROMPTS[2], max_tokens=6, priority=10, preempt=True))
    events = sched.step()
    # Equal priorities: the latest arrival is paused, with its KV kept.
    assert [e.paused for e in events if e.paused is not None] == [True]
    assert later.state is SeqState.PAUSED and low.state is not SeqState.PAUSED
    assert urgent.state is SeqState.PREFILL
    events += drain(sched)
    kinds = [(e.seq, e.paused) for e in events if e.paused is not None]
    assert kinds == [(later, True), (later, False)]
    # The paused one resumed before the waiting one of its own priority.
    done_order = [e.seq for e in events if e.result is not None]
    assert done_order.index(urgent) < done_order.index(waiting_same)
    resume_at = next(i for i, e in enumerate(events) if e.paused is False)
    first_same = next(i for i, e in enumerate(events) if e.seq is waiting_same)
    assert resume_at < first_same
    for s, prompt, n in ((low, PROMPTS[0], 20), (later, PROMPTS[1], 20),
                         (urgent, PROMPTS[2], 6)):
        assert s.result.token_ids == ref.greedy(eng2.tokenize(prompt), n, eos)


def test_nothing_preemptible_means_the_goal_waits(eng2):
    sched = stepper(eng2)
    a = sched.submit(seq(eng2, 'robot arm', max_tokens=8, priority=5))
    b = sched.submit(seq(eng2, 'the sky', max_tokens=8, priority=7))
    step_until(sched, lambda: b.state is SeqState.DECODE and a.state is SeqState.DECODE)
    urgent = sched.submit(seq(eng2, 'hello', max_tokens=2, priority=5, preempt=True))
    sched.step()
    assert urgent.state is SeqState.WAITING and not sched.paused()
    drain(sched)
    assert all(s.result.stop_reason is StopReason.LENGTH for s in (a, b, urgent))


def test_cancel_in_every_state_reaches_a_terminal_result(eng2):
    sched = stepper(eng2)
    eng2.reset_cache()
    running = sched.submit(seq(eng2, 'robot arm', max_tokens=40, priority=0))
    paused = sched.submit(seq(eng2, 'the sky', max_tokens=40, priority=-5))
    step_until(sched, lambda: paused.state is SeqState.DECODE)
    long_prompt = ' '.join(['the sky is blue'] * 5)
    prefilling = sched.submit(seq(eng2, long_prompt, max_tokens=40, priority=9, preempt=True))
    waiting = sched.submit(seq(eng2, 'x', max_tokens=4, priority=-9))
    step_until(sched, lambda: paused.state is SeqState.PAUSED
               and prefilling.state is SeqState.PREFILL)
    assert sched.cancel(waiting) is True and waiting.result.stop_reason is StopReason.CANCELLED
    for s in (running, paused, prefilling):
        assert sched.cancel(s) is False
    events = sched.step()
    done = results_of(events)
    for s in (running, paused, prefilling):
        assert done[id(s)].stop_reason is StopReason.CANCELLED
    assert sched.idle()
    # The caches stay consistent: a new request still matches a fresh engine's output.
    again = sched.submit(seq(eng2, 'robot arm', max_tokens=6))
    drain(sched)
    fresh = make_engine(eng2.model_dir and pathlib.Path(eng2.model_dir), 1)
    try:
        want = fresh.generate(GenerationRequest(
            prompt='robot arm', max_tokens=6, use_chat_template=False)).run_to_end()
    finally:
        fresh.close()
    assert again.result.token_ids == want.token_ids


def test_sessions_continue_in_any_slot(eng2):
    sched = stepper(eng2)
    eng2.reset_cache()
    turn = ' '.join(['the sky is blue'] * 3)
    first = sched.submit(seq(eng2, turn, max_tokens=4, session_id='s'))
    other = sched.submit(seq(eng2, 'robot arm', max_tokens=4, session_id='t'))
    drain(sched)
    follow = sched.submit(seq(eng2, 'and', max_tokens=4, session_id='s'))
    drain(sched)
    assert first.result.timings.cached_prompt_tokens == 0
    assert other.result.stop_reason is StopReason.LENGTH
    # The slot that holds session s's conversation live was picked (session affinity): its
    # first turn, prompt and answer, came from the KV.
    first_ids = first.result.prompt_tokens + first.result.completion_tokens
    assert follow.result.timings.cached_prompt_tokens >= first_ids - 1 - RECOMPUTE
    # Both slots overwritten by other sessions: s's prefix comes back from the shared store.
    for name in ('u', 'v'):
        sched.submit(seq(eng2, f'hello {name} robot', max_tokens=2, session_id=name))
    drain(sched)
    assert 's' in eng2.saved_sessions()
    third = sched.submit(seq(eng2, 'and blue', max_tokens=4, session_id='s'))
    drain(sched)
    follow_ids = follow.result.prompt_tokens + follow.result.completion_tokens
    assert third.result.timings.cached_prompt_tokens >= follow_ids - 1 - RECOMPUTE


def test_embedding_errors_end_only_that_sequence(eng2):
    import contextlib
    from edge_llm_ros.errors import InvalidRequestError
    sched = stepper(eng2)

    @contextlib.contextmanager
    def stale():
        raise InvalidRequestError('prefix_embeddings[0] cannot be mapped: stale')
        yield  # pragma: no cover

    bad = seq(eng2, 'robot arm', max_tokens=3)
    bad.embeddings = stale
    sched.submit(bad)
    good = sched.submit(seq(eng2, 'robot arm', max_tokens=3))
    drain(sched)
    assert bad.result.stop_reason is StopReason.ERROR and 'stale' in bad.result.error
    assert good.result.stop_reason is StopReason.LENGTH


# --- configuration ---------------------------------------------------------------------------
def test_parallel_sequences_range_and_kv_budget(tiny_dir):
    for bad in (0, 65, 2.0):
        with pytest.raises(ModelLoadError, match='parallel_sequences'):
            make_engine(tiny_dir, bad)
    info = load_model_info(str(tiny_dir))
    need = kv_budget_bytes(info, 96, 4)
    assert need == 4 * info.num_layers * 2 * info.num_kv_heads * 96 * info.head_dim * 4
    saved = 1 << 16
    with pytest.raises(ModelLoadError, match=f'needs {need} bytes.*plus {saved} bytes.*'
                       'lower parallel_sequences'):
        make_engine(tiny_dir, 4, kv_memory_limit=need + saved - 1, session_max_bytes=saved)
    eng = make_engine(tiny_dir, 4, kv_memory_limit=need + saved, session_max_bytes=saved)
    try:
        assert sum(b.nbytes for b in eng._decoder.kv_buffers) == need == eng.kv_bytes
    finally:
        eng.close()
    # Without kept prefixes only the slots count.
    make_engine(tiny_dir, 4, kv_memory_limit=need, prefix_reuse=False).close()
    with pytest.raises(ModelLoadError, match='lower parallel_sequences or max_context'):
        make_engine(tiny_dir, 64, max_context=96, kv_memory_limit=1 << 20)


def test_fixed_batch_graph_needs_reconversion(tiny_dir, tmp_path):
    old = tmp_path / 'fixed'
    shutil.copytree(tiny_dir, old)
    model = onnx.load(str(old / 'model.onnx'), load_external_data=False)
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == 'batch':
            dims[0].dim_value = 1
    onnx.save(model, str(old / 'model.onnx'))
    info = load_model_info(str(old))
    with pytest.raises(ModelLoadError, match='fixed batch of 1.*reconvert'):
        OnnxDecoder(str(old), info, SessionConfig(max_context=32, slots=2))
    OnnxDecoder(str(old), info, SessionConfig(max_context=32, slots=1))   # N=1 still loads


@pytest.mark.parametrize('level', [0, 4])
def test_the_row_policy_makes_every_row_count_agree_on_this_cpu(tmp_path_factory, level):
    """probe_rows: from min_rows rows on, a row's logits are the same bits at any row count.

    Whatever kernels this CPU's onnxruntime takes (one row and several differ on some CPUs
    at level 4 and on all at level 0), the probed policy must hold here.
    """
    model = tiny_model_dir(tmp_path_factory.mktemp(f'rows{level}'), accuracy_level=level)
    info = load_model_info(str(model))
    dec = OnnxDecoder(str(model), info, SessionConfig(max_context=32, slots=4,
                                                      intra_op_threads=1))
    policy = probe_rows(dec)
    assert policy.exact and 1 <= policy.min_rows <= 4, policy
    for slot in range(4):
        dec.run([Row(slot, 0, np.arange(5, 12) + slot)])
    rows = {b: dec.run([decode_row(i, 40 + i, 7) for i in range(b)])[0].copy()
            for b in (1, 2, 3, 4)}
    for b in range(policy.min_rows + 1, 5):
        np.testing.assert_array_equal(rows[policy.min_rows], rows[b])
    np.testing.assert_allclose(rows[1], rows[4], atol=1e-3)


def test_slot_views_share_the_buffers(tiny_dir):
    info = load_model_info(str(tiny_dir))
    dec = OnnxDecoder(str(tiny_dir), info, SessionConfig(max_context=32, slots=3))
    ids = np.array([5, 60, 70, 80])
    dec.run([Row(2, 0, ids)])
    for buf, view in zip(dec.kv_buffers, dec.slot_buffers(2)):
        assert np.shares_memory(buf, view) and np.any(view[:, :, :4] != 0)
        assert not np.any(buf[:2])     # slots 0 and 1 untouched by slot 2's prefill


def test_random_load_with_cancels_and_preemption_loses_nothing(tiny_dir):
    """A seeded storm of priorities, preemptions and cancels in every state on 3 slots."""
    import random
    rng = random.Random(7)
    eng = make_engine(tiny_dir, 3, prefill_chunk=3, max_context=128)
    try:
        sched = stepper(eng)
        seqs, ended, dropped, pauses = [], {}, set(), 0
        words = ('robot', 'arm', 'the', 'sky', 'is', 'blue', 'hello', 'once', 'upon')
        for step in range(600):
            if len(seqs) < 60 and rng.random() < 0.5:
                prompt = ' '.join(rng.choice(words) for _ in range(rng.randint(1, 12)))
                seqs.append(sched.submit(seq(
                    eng, prompt, max_tokens=rng.randint(1, 25),
                    priority=rng.randint(-3, 3), preempt=rng.random() < 0.5,
                    session_id=rng.choice(('', 'a', 'b')))))
            if seqs and rng.random() < 0.1:
                victim = rng.choice(seqs)
                if sched.cancel(victim):
                    dropped.add(id(victim))
            for event in sched.step():
                pauses += event.paused is True
                if event.result is not None:
                    assert id(event.seq) not in ended, 'a sequence ended twice'
                    ended[id(event.seq)] = event.result
        for event in drain(sched):
            if event.result is not None:
                assert id(event.seq) not in ended
                ended[id(event.seq)] = event.result
        assert len(seqs) == 60 and sched.idle()
        assert set(ended) | dropped == {id(s) for s in seqs} and not set(ended) & dropped
        reasons = {r.stop_reason for r in ended.values()}
        assert StopReason.CANCELLED in reasons and StopReason.ERROR not in reasons
        assert pauses >= 3   # preemption happened, and paused sequences ended too
        assert all(s.state is SeqState.DONE and s.result is not None for s in seqs)
        # Slots and caches are consistent afterwards: a request matches a fresh engine.
        again = sched.submit(seq(eng, 'robot arm the sky', max_tokens=8))
        drain(sched)
    finally:
        eng.close()
    fresh = make_engine(tiny_dir, 1)
    try:
        want = fresh.generate(GenerationRequest(prompt='robot arm the sky', max_tokens=8,
                                                use_chat_template=False)).run_to_end()
    finally:
        fresh.close()
    assert again.result.token_ids == want.token_ids
