"""The scheduler's plans against a fake executor: no model, no onnxruntime.

The scheduler only decides; these tests run its plans through FakeExecutor, which keeps the
slots' KVCache bookkeeping the way the real executor does (on tiny numpy buffers), makes up
logits, and checks on every plan what must hold whatever the policy: one row per slot, decode
rows of decoding goals before prompt rows, prompt rows within the prefill budget, KV moves
that name valid slots, and no goal planned after it ended.
"""
import random

import numpy as np
import pytest

from edge_llm_ros.runtime.kv_cache import block_hashes, KVCache
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings, TokenEvent
from edge_llm_ros.serving.goal import CancelReason, Goal, GoalState
from edge_llm_ros.serving.scheduler import (Admit, Checkpoint, DecodeRow, Outputs, Park, Plan,
                                            PrefillRow, Scheduler, Start, Unpark)

VOCAB = 16
CAP = 64


class FakeRequest:
    """What the scheduler reads of a prepared request."""

    def __init__(self, keys, max_tokens=4, session_id=''):
        self.keys = tuple(keys)
        self.cache_keys = self.keys   # no adapters: the prefix keys are the keys
        self.key_hashes = block_hashes(self.keys)
        self.max_tokens = max_tokens
        self.session_id = session_id
        self.embeddings = None
        self.spans = ()            # no images: no span is prefilled whole
        self.whole_spans = False


class FakeSequence:
    """The runtime side of a goal: token i+1 follows token i, max_tokens of them."""

    def draft_ask(self, room):
        return None   # no speculation here (test_speculative.py drives verify passes)

    def __init__(self, request, output):
        self.request = request
        self.output = output
        self.token = self.pos = 0
        self.done = False
        self.result = None
        self.reused = None

    def chunks(self, reused, chunk):
        self.reused = reused
        bounds = list(range(reused, len(self.request.keys), chunk)) + [len(self.request.keys)]
        return list(zip(bounds[:-1], bounds[1:]))

    def prefill_inputs(self, a, b):
        return np.asarray(self.request.keys[a:b]), None

    def whole_span(self, a, b):
        return False

    def prefilled(self, a, b, seconds):
        pass

    def start(self, logits, pos, room):
        self.pos = pos
        return self._emit(int(np.argmax(logits)))

    def advance(self, logits, started):
        self.pos += 1
        return self._emit(int(np.argmax(logits)))

    def _emit(self, token):
        self.token = token
        event = TokenEvent(token, f'<{token}>', len(self.output), 0.0)
        self.output.add(event)
        self.done = len(self.output) >= self.request.max_tokens
        return event

    def finish(self, reason=None, error=''):
        if self.result is None:
            stop = StopReason.ERROR if error else (reason or StopReason.LENGTH)
            self.result = GenerationResult(
                self.output.text(), self.output.token_ids(), stop, len(self.request.keys),
                len(self.output), Timings(), error=error)
        return self.result


class FakeExecutor:
    """Runs plans on KV bookkeeping only (see the module docstring)."""

    def __init__(self, caches, chunk):
        self.caches = caches
        self.chunk = chunk
        self.plans = []
        self.ended = set()

    def run(self, plan: Plan) -> Outputs:
        self._check(plan)
        self.plans.append(plan)
        out = Outputs()
        for op in plan.kv:
            cache = self.caches[op.slot]
            if isinstance(op, Start):
                op.goal.sequence = FakeSequence(op.goal.request, op.goal.output)
            elif isinstance(op, Admit):
                cache.apply(op.reuse, op.goal.request.session_id)
            elif isinstance(op, Park):
                op.goal.park = (cache.keys, [b[:, :, :cache.length].copy() for b in cache.buffers])
                cache.reset()
            elif isinstance(op, Unpark):
                keys, data = op.goal.park
                cache.take(keys, op.goal.request.session_id, data)
        for row in plan.rows:
            cache = self.caches[row.goal.slot]
            if isinstance(row, PrefillRow):
                cache.append(row.keys)
                out.logits.append(self._logits(row.keys[-1])[None])
            else:
                cache.append_token(row.token)
                out.logits.append(self._logits(row.token)[None])
        return out

    @staticmethod
    def _logits(last_key):
        logits = np.zeros(VOCAB, np.float32)
        logits[(int(last_key) + 1) % VOCAB] = 1.0
        return logits

    def _check(self, plan: Plan) -> None:
        slots = len(self.caches)
        for op in plan.kv:
            assert 0 <= op.slot < slots
            goal = getattr(op, 'goal', None)
            assert goal is None or goal.uid not in self.ended, 'a KV move of an ended goal'
        rows = plan.rows
        assert len({row.goal.slot for row in rows}) == len(rows), 'two rows of one slot'
        kinds = [isinstance(row, PrefillRow) for row in rows]
        assert kinds == sorted(kinds), 'a decode row after a prompt row'
        assert sum(r.stop - r.start for r in rows if isinstance(r, PrefillRow)) <= self.chunk
        for row in rows:
            assert row.goal.uid not in self.ended
            assert row.goal.state is (GoalState.PREFILL if isinstance(row, PrefillRow)
                                      else GoalState.DECODE)


class Rig:
    def __init__(self, slots=2, chunk=4, reuse=True):
        self.caches = [KVCache([np.zeros((1, 1, CAP, 2), np.float32)], CAP)
                       for _ in range(slots)]
        self.executor = FakeExecutor(self.caches, chunk)
        self.sched = Scheduler(self.caches, chunk, prefix_reuse=reuse)

    def goal(self, keys, max_tokens=4, priority=0, preempt=False, session_id=''):
        return self.sched.submit(Goal(FakeRequest(keys, max_tokens, session_id),
                                      priority=priority, preempt=preempt))

    def plan(self, admit=True):
        plan = self.sched.schedule(admit)
        report = self.sched.update(plan, self.executor.run(plan))
        for goal in report.ended:
            assert goal.uid not in self.executor.ended, 'a goal ended twice'
            self.executor.ended.add(goal.uid)
        self._check_slots()
        return plan, report

    def step(self):
        return [self.plan(), self.plan()]

    def drain(self, limit=2000):
        for _ in range(limit):
            if self.sched.idle():
                return
            self.step()
        raise AssertionError('did not drain')

    def _check_slots(self):
        occupied = [i for i, g in enumerate(self.sched._slot) if g is not None]
        for i, goal in enumerate(self.sched._slot):
            if goal is not None:
                assert goal.slot == i and goal.state in (GoalState.PREFILL, GoalState.DECODE)
        assert len(set(occupied)) == len(occupied)


def test_one_plan_kind_puts_decode_rows_and_prompt_chunks_in_one_call():
    rig = Rig(slots=2)
    a = rig.goal(range(1, 10), max_tokens=3)
    plan, _ = rig.plan()   # the executor builds its Sequence (session turns, images) ...
    assert [type(op) for op in plan.kv] == [Start] and plan.rows == []
    plan, _ = rig.plan()   # ... then its prompt's KV is admitted and prefilled
    assert [type(op) for op in plan.kv] == [Admit]
    assert [(type(r), r.start, r.stop, r.last) for r in plan.rows] == [(PrefillRow, 0, 4, False)]
    plan, _ = rig.plan()
    assert [(r.start, r.stop) for r in plan.rows] == [(4, 8)]
    plan, report = rig.plan()   # the last piece: its logits give the first token
    assert [(r.start, r.stop, r.last) for r in plan.rows] == [(8, 9, True)]
    assert report.tokens == [a] and a.state is GoalState.DECODE
    b = rig.goal(range(2, 8), max_tokens=2)
    plan, _ = rig.plan()   # b starts beside a's decode row
    assert [type(op) for op in plan.kv] == [Start] and [r.goal for r in plan.rows] == [a]
    plan, _ = rig.plan()   # a decodes while b's first chunk runs: one call, two rows
    assert [type(r) for r in plan.rows] == [DecodeRow, PrefillRow]
    assert plan.rows[0].goal is a and plan.rows[0].position == 10 and plan.rows[1].goal is b
    rig.drain()
    assert a.result.completion_tokens == 3 and a.state is GoalState.DONE
    assert a.output.token_ids() == [10, 11, 12]   # the fake's logits: last key + 1
    assert b.output.token_ids() == [8, 9]


def test_the_prefill_budget_is_shared_by_prompts_most_urgent_first():
    rig = Rig(slots=3, chunk=8)
    low = rig.goal(range(1, 7), max_tokens=1)
    high = rig.goal(range(10, 16), max_tokens=1, priority=3)
    rig.plan()
    plan, _ = rig.plan()
    assert [(r.goal, r.start, r.stop) for r in plan.rows] == [(high, 0, 6), (low, 0, 2)]
    plan, _ = rig.plan()
    assert [(r.goal, r.start, r.stop, r.last) for r in plan.rows] == [(low, 2, 6, True)]
    rig.drain()
    assert low.output.token_ids() == [7] and high.output.token_ids() == [0]   # 16 % VOCAB


def test_a_freed_slot_is_filled_and_no_goal_moves():
    rig = Rig(slots=3, chunk=16)
    short = rig.goal([1, 2, 3], max_tokens=1)
    mid = rig.goal([4, 5, 6], max_tokens=30)
    high = rig.goal([7, 8, 9], max_tokens=30)
    while not short.done:
        rig.step()
    while high.state is not GoalState.DECODE or mid.state is not GoalState.DECODE:
        rig.step()
    rig.step()
    assert (mid.slot, high.slot) == (1, 2)   # a varlen call needs no contiguous rows
    rows = rig.executor.plans[-1].rows
    assert [(r.goal, r.goal.slot) for r in rows] == [(mid, 1), (high, 2)]
    late = rig.goal([10, 11], max_tokens=2)
    rig.plan()
    assert late.slot == 0
    rig.drain()
    assert [g.result.completion_tokens for g in (short, mid, high, late)] == [1, 30, 30, 2]


def test_priority_then_arrival_and_preemption_parks_then_unparks():
    rig = Rig(slots=1)
    low = rig.goal([1, 2], max_tokens=20)
    rig.step()
    rig.step()
    waiting = rig.goal([3], max_tokens=2, priority=0)
    urgent = rig.goal([4, 5], max_tokens=2, priority=5, preempt=True)
    plan, report = rig.plan()
    assert [type(op) for op in plan.kv] == [Park, Start]
    assert plan.kv[0].goal is low and report.paused == [low] and low.state is GoalState.PAUSED
    plan, _ = rig.plan()
    assert [r.goal for r in plan.rows] == [urgent] and urgent.slot == 0
    rig.drain()
    unparks = [op for p in rig.executor.plans for op in p.kv if isinstance(op, Unpark)]
    assert [op.goal for op in unparks] == [low]
    assert all(g.done for g in (urgent, low, waiting))
    # The paused goal resumed (same priority as `waiting`) before `waiting` started.
    first_waiting = next(i for i, p in enumerate(rig.executor.plans)
                         if any(getattr(op, 'goal', None) is waiting for op in p.kv))
    resume = next(i for i, p in enumerate(rig.executor.plans)
                  if any(isinstance(op, Unpark) for op in p.kv))
    assert resume < first_waiting
    assert low.result.completion_tokens == 20 and low.output.token_ids()[:2] == [3, 4]


def test_nothing_preemptible_keeps_the_head_waiting():
    rig = Rig(slots=1)
    busy = rig.goal([1], max_tokens=10, priority=5)
    rig.step()
    head = rig.goal([2], max_tokens=1, priority=5, preempt=True)
    plan, _ = rig.plan()
    assert not any(isinstance(op, Park) for op in plan.kv) and head.state is GoalState.WAITING
    rig.drain()
    assert busy.result.completion_tokens == 10 and head.result.completion_tokens == 1


def test_prefix_reuse_copies_from_another_slot_and_sessions_checkpoint():
    rig = Rig(slots=2, chunk=64)
    prompt = list(range(1, 40))
    first = rig.goal(prompt, max_tokens=30, session_id='s')
    rig.step()
    second = rig.goal(prompt + [50, 51], max_tokens=2)
    rig.plan()
    plan, _ = rig.plan()
    admit = next(op for op in plan.kv if isinstance(op, Admit) and op.goal is second)
    # The longest prefix lives in slot 0's live KV, which another goal still extends.
    assert admit.slot == 1 and admit.reuse.source is rig.caches[0]
    assert admit.reuse.length == len(prompt)
    rig.drain()
    assert second.sequence is None and first.result.completion_tokens == 30
    checkpoints = [op for p in rig.executor.plans for op in p.kv if isinstance(op, Checkpoint)]
    assert len(checkpoints) == 2   # one per ended goal's slot


def test_cancel_in_every_state_ends_each_goal_once():
    rig = Rig(slots=1, chunk=2)
    running = rig.goal([1, 2], max_tokens=40)
    rig.step()
    rig.step()
    prefilling = rig.goal(list(range(10, 30)), max_tokens=40, priority=9, preempt=True)
    rig.plan()
    waiting = rig.goal([3], max_tokens=1, priority=-1)
    assert running.state is GoalState.PAUSED and prefilling.state is GoalState.PREFILL
    assert rig.sched.cancel(waiting) is True and waiting.result.stop_reason is \
        StopReason.CANCELLED
    for goal in (running, prefilling):
        assert rig.sched.cancel(goal, CancelReason.CLIENT) is False
        assert goal.cancel_reason is CancelReason.CLIENT
    rig.drain()
    for goal in (running, prefilling):
        assert goal.result.stop_reason is StopReason.CANCELLED and goal.done
    assert rig.sched.idle()


def test_a_failed_kv_move_or_model_call_ends_only_its_goals():
    rig = Rig(slots=2)
    a = rig.goal([1, 2, 3], max_tokens=5)
    b = rig.goal([4, 5, 6], max_tokens=5)
    plan = rig.sched.schedule()
    out = rig.executor.run(plan)
    out.failed[b.uid] = RuntimeError('copy failed')
    report = rig.sched.update(plan, out)
    assert report.ended == [b] and b.result.stop_reason is StopReason.ERROR
    assert 'copy failed' in b.result.error and not a.done
    assert b.slot == -1 and rig.sched._slot[1] is None   # its Start failed: slot freed
    assert not any(isinstance(op, Checkpoint) for op in rig.sched._deferred)
    rig.drain()
    assert a.result.completion_tokens == 5
    # A failed model call ends every goal with a row in it, and only those.
    c = rig.goal([7, 8], max_tokens=5)
    d = rig.goal([9, 10, 11, 12, 13, 14], max_tokens=5)   # two chunks: 2 positions, then 4
    for _ in range(10):
        if c.state is GoalState.DECODE and d.chunks:
            break
        rig.plan()
    assert c.state is GoalState.DECODE and d.state is GoalState.PREFILL and d.chunks
    e = rig.goal([1], max_tokens=2)
    plan = rig.sched.schedule()
    assert {r.goal for r in plan.rows} == {c, d}
    out = rig.executor.run(plan)
    out.error = RuntimeError('device lost')
    report = rig.sched.update(plan, out)
    assert set(report.ended) == {c, d} and 'device lost' in c.result.error
    rig.drain()
    assert e.result.completion_tokens == 2


@pytest.mark.parametrize('seed', [1, 2, 3])
def test_random_storm_loses_nothing(seed):
    rng = random.Random(seed)
    rig = Rig(slots=3, chunk=3)
    goals = []
    for _ in range(400):
        if len(goals) < 50 and rng.random() < 0.5:
            keys = [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
            goals.append(rig.goal(keys, max_tokens=rng.randint(1, 12),
                                  priority=rng.randint(-2, 2), preempt=rng.random() < 0.3,
                                  session_id=rng.choice(('', 'a', 'b'))))
        if goals and rng.random() < 0.1:
            rig.sched.cancel(rng.choice(goals))
        rig.plan()
    rig.drain()
    assert all(g.done and g.result is not None for g in goals)
    assert all(g.result.stop_reason in (StopReason.LENGTH, StopReason.CANCELLED)
               for g in goals)
    assert sum(isinstance(op, Park) for p in rig.executor.plans for op in p.kv) >= 1
    assert all(c.length == 0 or c.owner is not None for c in rig.caches)
    assert rig.sched.idle()
