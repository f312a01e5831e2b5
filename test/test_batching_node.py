"""Continuous batching through the action (issue 14): a real llm_node on SmolLM2, 2 slots.

One node process for the module (engine.parallel_sequences 2), greedy. The model's EOS
tokens are biased away (logit_bias -100) so a goal runs exactly max_tokens: long goals keep
both slots busy for seconds, which is what preemption and cancels need.
"""
import threading
import time
from typing import List

from compat_matrix import SMOLLM2_TYPES
from llm_node_harness import served, wait_feedback_delivered
import pytest
import yaml

from edge_llm_msgs.action import Generate
from edge_llm_ros.convert.default_model import ensure_default_model

pytestmark = pytest.mark.slow

NODE = 'llm_batching_test'
SLOTS = 2
LONG = 160          # tokens of a long goal: seconds of decoding with two streams
PROMPTS = ('Describe how a robot arm picks up a cup.',
           'Write a short poem about a lidar sensor.',
           'List three things a delivery robot checks before leaving the dock.')


@pytest.fixture(scope='module')
def llm():
    params = {'autostart': True, 'engine.parallel_sequences': SLOTS, 'kv.max_context': 512,
              'feedback.period_tokens': 1, 'queue.depth': 8, 'max_tokens': 32,
              'sampling.temperature': 0.0}
    with served(NODE, params, 'batching_test_client', timeout=300) as client:
        llm = client.llm('/' + NODE)
        wait_feedback_delivered(llm)
        yield llm


@pytest.fixture(scope='module')
def no_eos() -> dict:
    """logit_bias that keeps the model from ending early (every EOS id at -100)."""
    spec = yaml.safe_load((ensure_default_model() / 'model.yaml').read_text())
    return {int(t): -100.0 for t in spec['eos_token_ids']}


class Tracked:
    """A goal and what its feedback said: paused transitions, queue positions, tokens."""

    def __init__(self, llm, prompt: str, max_tokens: int, bias: dict, **extra) -> None:
        self.paused: List[bool] = []         # every change of feedback.paused, in order
        self.handle_paused: List[bool] = []  # GenerationHandle.paused at those changes
        self.queued: List[int] = []
        self.tokens = 0
        self.first_token_at = None
        self._lock = threading.Lock()
        self.handle = llm.generate(prompt, max_tokens=max_tokens, logit_bias=bias,
                                   on_feedback=self._on_feedback, **extra)

    def _on_feedback(self, fb) -> None:
        with self._lock:
            if (self.paused[-1] if self.paused else False) != fb.paused:
                self.paused.append(bool(fb.paused))
                # LLMClient updates its handle before it calls on_feedback.
                self.handle_paused.append(self.handle.paused)
            if fb.queue_position:
                self.queued.append(int(fb.queue_position))
            if fb.completion_tokens and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.tokens = max(self.tokens, int(fb.completion_tokens))

    def wait_tokens(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.tokens < n:
            assert not self.handle.done(), f'ended before {n} tokens: {self.handle.result()}'
            assert time.monotonic() < deadline, f'no {n} tokens within {timeout} s'
            time.sleep(0.01)

    def result(self, timeout: float = 300.0):
        return self.handle.result(timeout=timeout)


def test_concurrent_goals_equal_each_goal_run_alone(llm, no_eos, compat):
    compat('llama', SMOLLM2_TYPES, 'batching')
    alone = [llm.generate(p, max_tokens=24, logit_bias=no_eos).result(timeout=120)
             for p in PROMPTS]
    # Three at once on two slots: one waits, joins when a slot frees.
    together = [llm.generate(p, max_tokens=24, logit_bias=no_eos) for p in PROMPTS]
    together = [h.result(timeout=300) for h in together]
    for one, many in zip(alone, together):
        assert one.ok and many.ok, (one, many)
        assert many.completion_tokens == 24
        assert many.token_ids == one.token_ids, (one.text, many.text)
        assert many.text == one.text


def test_preempt_pauses_the_lowest_running_goal_which_resumes(llm, no_eos):
    alone = llm.generate(PROMPTS[1], max_tokens=LONG, logit_bias=no_eos).result(timeout=300)
    keep = Tracked(llm, PROMPTS[0], LONG, no_eos, priority=0)
    low = Tracked(llm, PROMPTS[1], LONG, no_eos, priority=-1)
    keep.wait_tokens(2)
    low.wait_tokens(2)
    urgent = Tracked(llm, 'Is the path clear? Answer yes or no.', 8, no_eos,
                     priority=Generate.Goal.PRIORITY_MAX, preempt=True)
    first = urgent.result()
    assert first.ok and first.completion_tokens == 8, first
    low_out, keep_out = low.result(), keep.result()
    assert low_out.ok and keep_out.ok, (low_out, keep_out)
    assert low.paused == [True, False], low.paused     # paused, then resumed
    assert low.handle_paused == [True, False] and not low.handle.paused
    assert keep.paused == [], keep.paused              # the higher one kept running
    assert low_out.completion_tokens == LONG
    # Its KV was kept: the resumed goal continues exactly as if never paused.
    assert low_out.token_ids == alone.token_ids


def test_preempt_with_nothing_lower_running_waits_at_the_head(llm, no_eos):
    busy = [Tracked(llm, p, 48, no_eos, priority=10) for p in PROMPTS[:SLOTS]]
    for goal in busy:
        goal.wait_tokens(1)
    waiting = Tracked(llm, PROMPTS[2], 4, no_eos, priority=5, preempt=True)
    out = waiting.result()
    assert out.ok, out
    assert waiting.queued and waiting.queued[0] == 1, waiting.queued
    for goal in busy:
        assert goal.result().ok and goal.paused == []


def test_queue_orders_by_priority_then_arrival(llm, no_eos):
    busy = [Tracked(llm, p, 32, no_eos) for p in PROMPTS[:SLOTS]]
    for goal in busy:
        goal.wait_tokens(1)
    early_low = Tracked(llm, PROMPTS[0], 4, no_eos, priority=-3)
    late_high = Tracked(llm, PROMPTS[1], 4, no_eos, priority=3)
    for goal in busy + [early_low, late_high]:
        assert goal.result().ok
    assert late_high.first_token_at < early_low.first_token_at


@pytest.mark.parametrize('priority', [Generate.Goal.PRIORITY_MAX + 1,
                                      Generate.Goal.PRIORITY_MIN - 1])
def test_out_of_range_priority_is_an_invalid_request(llm, priority):
    out = llm.generate('hi', max_tokens=4, priority=priority).result(timeout=60)
    assert out.status == 'aborted' and out.error_kind == 'invalid_request', out
    assert f'priority {priority} is outside [-100, 100]' in out.error_message


def test_cancel_queued_running_and_paused_goals(llm, no_eos):
    running = Tracked(llm, PROMPTS[0], LONG, no_eos, priority=0)
    paused = Tracked(llm, PROMPTS[1], LONG, no_eos, priority=-1)
    running.wait_tokens(1)
    paused.wait_tokens(1)
    urgent = Tracked(llm, PROMPTS[2], LONG, no_eos, priority=50, preempt=True)
    urgent.wait_tokens(1)
    queued = Tracked(llm, PROMPTS[0], LONG, no_eos, priority=-10)
    deadline = time.monotonic() + 60
    while not (paused.paused[-1:] == [True] and queued.queued):
        assert time.monotonic() < deadline, (paused.paused, queued.queued)
        time.sleep(0.01)
    for goal in (queued, paused, urgent, running):
        assert goal.handle.cancel(timeout=30)
    outcomes = [g.result(timeout=60) for g in (queued, paused, urgent, running)]
    assert [o.status for o in outcomes] == ['canceled'] * 4, outcomes
    assert outcomes[0].completion_tokens == 0                # never ran
    assert 0 < outcomes[1].completion_tokens < LONG          # partial text kept
    # Nothing left behind: the next goal gets a slot at once.
    after = llm.generate('hi', max_tokens=2).result(timeout=60)
    assert after.ok and after.timings.queue_wait_s < 1.0, after
