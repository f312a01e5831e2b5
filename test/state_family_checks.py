"""Engine checks shared by the families tested on tiny models (lfm2, qwen35, smollm3, granite).

Each family's test file converts its own tiny model and runs these: goals batched with prompt
chunks beside decode rows give each goal's bits alone, a preempted goal resumes with its
states, prefix reuse stops at kept states, a session continues from its saved states (in
memory, and in SQLite after a restart) as the conversation sent whole. The primitives (an
engine on one thread, a greedy goal with logprobs, a chat turn) are the ones every such test
uses.
"""
import json
import pathlib
from typing import List

from decoder_calls import record_calls
from llama_cpp_parity import llama_cpp_greedy, PROMPT
import numpy as np
from ort_driver import OrtDriver
from test_llama_cpp_parity import KQUANT_MAX_ABS_DIFF, MAX_ABS_DIFF

from edge_llm_ros.runtime.speculative import SpeculativeConfig
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.goal import Goal, GoalState
from edge_llm_ros.serving.scheduler import Park, Unpark

TEXTS = ('once upon a time there was a robot', 'the blue sky is blue', 'Hello robot arm',
         'What color is the sky?')
USER1 = ChatMessage('user', 'once upon a time there was a robot')
USER2 = ChatMessage('user', 'What color is the sky?')


def engine(model_dir: pathlib.Path, n: int = 1, **kw) -> Engine:
    """Open an engine on one thread with n slots (max_context 96 unless given)."""
    kw.setdefault('max_context', 96)
    return Engine(EngineConfig(model_dir=str(model_dir), intra_op_threads=1,
                               parallel_sequences=n, **kw))


def goal(eng: Engine, text: str, max_tokens: int = 12, **kw) -> Goal:
    """Prepare a greedy raw-prompt goal that keeps its logprobs."""
    request = GenerationRequest(prompt=text, max_tokens=max_tokens, use_chat_template=False,
                                sampling=SamplingConfig(temperature=0.0, logprobs=True))
    return Goal(eng.prepare(request), **kw)


def bits(g: Goal) -> tuple:
    """Return a goal's token ids and logprobs."""
    return g.result.token_ids, [lp.logprob for lp in g.result.logprobs]


def eng_goal(eng: Engine, text: str, max_tokens: int = 12) -> Goal:
    """Run one goal to its end on the engine's own loop."""
    g = eng.scheduler().submit(goal(eng, text, max_tokens=max_tokens))
    while not g.done:
        eng.run_plan()
    return g


def alone_bits(model_dir: pathlib.Path) -> dict:
    """Give each text's tokens and logprobs when it runs by itself on one slot."""
    eng = engine(model_dir)
    try:
        return {text: bits(eng_goal(eng, text, max_tokens=16)) for text in TEXTS}
    finally:
        eng.close()


def run(eng: Engine, steps) -> List[object]:
    """Run plans until the scheduler idles; return the plans the executor ran."""
    plans = []
    executor = eng.loop.executor
    run_plan = executor.run

    def recording(plan):
        plans.append(plan)
        return run_plan(plan)
    executor.run = recording
    try:
        for _ in range(steps):
            if eng.scheduler().idle():
                return plans
            eng.run_plan()
    finally:
        executor.run = run_plan
    raise AssertionError('the scheduler did not drain')


def batched(eng: Engine) -> tuple:
    """Run a decoding goal and two whose prompts prefill in chunks beside it.

    Their prompt chunks share model calls with the decode rows. Returns the goals and the
    plans.
    """
    sched = eng.scheduler()
    first = sched.submit(goal(eng, TEXTS[0], max_tokens=6))
    while first.state is not GoalState.DECODE:
        eng.run_plan()
    rest = [sched.submit(goal(eng, t, max_tokens=16)) for t in TEXTS[1:3]]
    plans = run(eng, 5000)
    return [first] + rest, plans


def check_batched_equals_alone(model_dir: pathlib.Path, alone: dict) -> list:
    """Batch three goals (chunks beside decode rows); each gives its bits alone.

    Returns the model calls as [(slot, rows)] per call, for further checks.
    """
    eng = engine(model_dir, 3, prefill_chunk=3)
    recorded = record_calls(eng._decoder)
    try:
        goals, _ = batched(eng)
    finally:
        eng.close()
    calls = [[(row.slot, row.length) for row in call] for call in recorded]
    assert bits(goals[0])[1] == alone[TEXTS[0]][1][:6]
    for g, text in zip(goals[1:], TEXTS[1:3]):
        assert bits(g) == alone[text], text
    # Decode rows and prompt chunks of other slots ran in one call.
    assert any(any(n == 1 for _, n in call) and any(n > 1 for _, n in call) for call in calls)
    return calls


def turn(eng: Engine, messages, session: str = '', max_tokens: int = 8):
    """Run one greedy chat turn to its end, its logprobs kept."""
    return eng.generate(GenerationRequest(
        messages=list(messages), session_id=session, max_tokens=max_tokens,
        sampling=SamplingConfig(temperature=0.0, logprobs=True))).run_to_end()


def result_bits(result) -> tuple:
    """Return a result's token ids and logprobs."""
    return result.token_ids, [lp.logprob for lp in result.logprobs]


def two_turns_sent_whole(model_dir: pathlib.Path, **kw) -> tuple:
    """Give both turns of a conversation sent whole, with nothing cached (kw: EngineConfig)."""
    plain = engine(model_dir, max_context=256, prefix_reuse=False, **kw)
    try:
        first = turn(plain, [USER1])
        second = turn(plain, [USER1, ChatMessage('assistant', first.text), USER2])
    finally:
        plain.close()
    assert second.timings.cached_prompt_tokens == 0
    return first, second


def check_sqlite_session_after_restart(model_dir: pathlib.Path, store: str,
                                       whole: tuple) -> None:
    """Store a session's first turn, restart, continue it: equal to the whole conversation."""
    first, second = whole
    eng = engine(model_dir, max_context=256, session_store=store)
    try:
        a1 = turn(eng, [USER1], 'a')
    finally:
        eng.close()
    eng = engine(model_dir, max_context=256, session_store=store)
    try:
        assert eng.saved_sessions() == ['a']
        a2 = turn(eng, [USER1, ChatMessage('assistant', a1.text), USER2], 'a')
    finally:
        eng.close()
    assert result_bits(a1) == result_bits(first)
    assert result_bits(a2) == result_bits(second)
    assert a2.timings.cached_prompt_tokens == a1.prompt_tokens + a1.completion_tokens - 1


def check_int8_kv_session(model_dir: pathlib.Path) -> None:
    """kv.dtype int8 (model_kv_int8.onnx) beside float fixed states: a session continues."""
    first, second = two_turns_sent_whole(model_dir, kv_dtype='int8')
    eng = engine(model_dir, max_context=256, kv_dtype='int8')
    try:
        assert eng.live_kv_dtype == 'int8'
        a1 = turn(eng, [USER1], 'a')
        turn(eng, [USER2], 'b', max_tokens=3)   # a is saved as a snapshot: int8 rows, states
        a2 = turn(eng, [USER1, ChatMessage('assistant', a1.text), USER2], 'a')
    finally:
        eng.close()
    assert result_bits(a1) == result_bits(first)
    assert result_bits(a2) == result_bits(second)
    assert a2.timings.cached_prompt_tokens == a1.prompt_tokens + a1.completion_tokens - 1


def check_preempted_goals_resume(model_dir: pathlib.Path, alone: dict) -> None:
    """Two goals parked for an urgent one resume with their states: each gives its bits alone."""
    eng = engine(model_dir, 2)
    sched = eng.scheduler()
    try:
        low = [sched.submit(goal(eng, t, max_tokens=16)) for t in TEXTS[:2]]
        while any(len(g.output.events) < 3 for g in low):
            eng.run_plan()
        urgent = sched.submit(goal(eng, TEXTS[2], max_tokens=16, priority=10, preempt=True))
        plans = run(eng, 5000)
    finally:
        eng.close()
    assert any(isinstance(op, Park) for p in plans for op in p.kv)
    assert any(isinstance(op, Unpark) for p in plans for op in p.kv)
    for g, text in zip(low + [urgent], TEXTS[:3]):
        assert bits(g) == alone[text], text


def check_prefix_reuse_equals_uncached(model_dir: pathlib.Path, extensions=(TEXTS[1],)) -> None:
    """Prompts extending an earlier one reuse it up to its prompt's end, bit for bit."""
    first = TEXTS[0]
    later = [first + ' ' + text for text in extensions]
    plain = engine(model_dir, prefix_reuse=False)
    try:
        want = []
        for text in later:
            g = eng_goal(plain, text)
            want.append((bits(g), g.result.timings.cached_prompt_tokens))
    finally:
        plain.close()
    assert all(cached == 0 for _, cached in want)
    eng = engine(model_dir, prefix_reuse=True)
    try:
        assert eng.prefix_reuse
        eng_goal(eng, first, max_tokens=4)
        prompt_end = len(eng.tokenize(first))
        for text, (expected, _) in zip(later, want):
            g = eng_goal(eng, text)
            assert bits(g) == expected, text
            # Reused up to the first prompt's end, where its states were kept.
            assert g.result.timings.cached_prompt_tokens == prompt_end
    finally:
        eng.close()


def check_session_continues(model_dir: pathlib.Path, two_turns_whole: tuple) -> list:
    """Session a, saved while b takes the only slot, continues as the chat sent whole.

    Returns the positions of b's snapshot's kept states.
    """
    first, second = two_turns_whole
    eng = engine(model_dir, max_context=256)
    try:
        a1 = turn(eng, [USER1], 'a')
        # b takes the only slot (a's turn is saved as a snapshot) and ends on other tokens
        # than a, so its states there differ from a's.
        turn(eng, [USER2], 'b', max_tokens=3)
        a2 = turn(eng, [USER1, ChatMessage('assistant', a1.text), USER2], 'a')
        ends = sorted(eng._store.get('b').states)
    finally:
        eng.close()
    assert result_bits(a1) == result_bits(first)
    assert result_bits(a2) == result_bits(second)
    # Continued from the end of a's first turn (its last token was never fed), where the
    # snapshot kept its states.
    assert a2.timings.cached_prompt_tokens == a1.prompt_tokens + a1.completion_tokens - 1
    return ends


GREEDY = SamplingConfig(temperature=0.0, logprobs=True)


def check_speculation_equals_plain(model_dir: pathlib.Path, draft_dir: pathlib.Path,
                                   slots: int = 2, n_texts: int = 2, max_tokens: int = 20,
                                   samplings=(GREEDY,), some_rejected: bool = True) -> None:
    """Rejected drafts (prompt lookup, a draft model) go back to the verify start: plain's ids.

    Each sampling runs the texts with speculation off, prompt lookup and the draft model; the
    two speculative runs must give plain's ids and logprobs. `some_rejected`: the drafts must
    also have been rejected at least once (else only accepted drafts were checked).
    """
    texts = [' '.join([t] * 4) for t in TEXTS[:n_texts]]   # repetitive: prompt lookup drafts
    modes = {'off': SpeculativeConfig(mode='off'),
             'prompt_lookup': SpeculativeConfig(mode='prompt_lookup'),
             'draft': SpeculativeConfig(mode='draft', draft_model=str(draft_dir))}
    for sampling in samplings:
        runs = {}
        for mode, config in modes.items():
            eng = engine(model_dir, slots, max_context=256, speculative=config)
            try:
                sched = eng.scheduler()
                goals = [sched.submit(Goal(eng.prepare(GenerationRequest(
                    prompt=t, max_tokens=max_tokens, use_chat_template=False,
                    sampling=sampling)))) for t in texts]
                while not all(g.done for g in goals):
                    eng.run_plan()
                runs[mode] = ([bits(g) for g in goals], eng.speculation.stats)
            finally:
                eng.close()
        plain, _ = runs.pop('off')
        for mode, (spec, stats) in runs.items():
            assert spec == plain, (mode, sampling)
            assert stats.passes > 0 and stats.accepted > 0, (mode, stats)
            if some_rejected:
                assert stats.accepted < stats.drafted, (mode, stats)


def check_uncleared_states_matter(work: pathlib.Path, source: pathlib.Path,
                                  model_dir: pathlib.Path, states: int, what: str) -> None:
    """Control: the states cleared after the prompt move the logits past the parity bound."""
    ref, tokens = llama_cpp_greedy(source, work / f'{source.stem}.llama_cpp.npz')
    drv = OrtDriver(model_dir, max_ctx=64)
    rows = [drv.step(list(PROMPT)).copy()]
    bufs = [buf for name, _, buf in drv.bound if name.startswith('past_conv.')]
    assert len(bufs) == states
    for tok in tokens[:8]:
        for buf in bufs:
            buf[...] = 0
        rows.append(drv.step([tok]).copy())
    np.testing.assert_allclose(rows[0], ref[0], atol=KQUANT_MAX_ABS_DIFF)
    moved = float(np.abs(np.stack(rows[1:]) - ref[1:9]).max())
    print(f'{what} states cleared after the prompt: max |dlogit| {moved:.2f}')
    assert moved > 2 * MAX_ABS_DIFF


def check_chunks_equal_one_call(model_dir: pathlib.Path, prompt: List[int]) -> None:
    """Check that a prompt fed in three chunks gives the logits and KV of one call."""
    whole = OrtDriver(model_dir, max_ctx=64)
    want = whole.step(prompt)
    parts = OrtDriver(model_dir, max_ctx=64)
    for a, b in ((0, 4), (4, 5), (5, len(prompt))):
        got = parts.step(prompt[a:b])
    assert np.array_equal(got, want)
    for x, y in zip(whole.kv, parts.kv):
        assert np.array_equal(x, y)


MOVE_TO = [{'type': 'function', 'function': {
    'name': 'move_to', 'description': 'Drive to a point.',
    'parameters': {'type': 'object',
                   'properties': {'place': {'type': 'string', 'enum': ['dock', 'shelf']}},
                   'required': ['place']}}}]


def check_forced_tool_call(model_dir: pathlib.Path, tool_call_format: str, **kw) -> dict:
    """Check that a required tool call comes back parsed by the family's format.

    A random model writes no call by itself: the tool constraint forces one (a Hermes JSON
    object between <tool_call> markers), which the family's parser must read. `kw` go to
    the request (reasoning_budget=0 closes a think block at once). Returns the model_info.
    """
    eng = engine(model_dir, max_context=1024)
    try:
        info = eng.model_info()
        assert info['tool_call_format'] == tool_call_format
        result = eng.generate(GenerationRequest(prompt='Go to the dock.', tools=MOVE_TO,
                                                tool_choice='required', max_tokens=200,
                                                parallel_tool_calls=False, **kw)).run_to_end()
    finally:
        eng.close()
    assert [c.name for c in result.tool_calls] == ['move_to'], result
    assert json.loads(result.tool_calls[0].arguments)['place'] in ('dock', 'shelf')
    return info
