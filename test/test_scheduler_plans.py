"""The scheduler's plans against a fake executor: no model, no onnxruntime.

The scheduler only decides; these tests run its plans through FakeExecutor, which keeps the
slots' KVCache bookkeeping the way the real executor does (on tiny numpy buffers), makes up
logits, and checks on every plan what must hold whatever the policy: at most one model call,
decode rows start at row 0 with no idle slot below a decoding one, KV moves name valid slots,
and no goal is planned after it ended.
"""
import random

import numpy as np
import pytest

from edge_llm_ros.runtime.kv_cache import block_hashes, KVCache
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings, TokenEvent
from edge_llm_ros.serving.goal import CancelReason, Goal, GoalState
from edge_llm_ros.serving.scheduler import (Admit, Checkpoint, Move, Outputs, Park, Plan,
                                            Scheduler, Unpark)

VOCAB = 16
CAP = 64


class FakeRequest:
    """What the scheduler reads of a prepared request."""

    def __init__(self, keys, max_tokens=4, session_id=''):
        self.keys = tuple(keys)
        self.key_hashes = block_hashes(self.keys)
        self.max_tokens = max_tokens
        self.session_id = session_id
        self.embeddings = None
        self.spans = ()            # no images: no span is prefilled whole
        self.whole_spans = False


class FakeSequence:
    """The runtime side of a goal: token i+1 follows token i, max_tokens of them."""

    def draft(self, room):
        return []   # no speculation here (test_speculative.py drives verify passes)

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

    def __init__(self, caches):
        self.caches = caches
        self.plans = []
        self.ended = set()

    def run(self, plan: Plan) -> Outputs:
        self._check(plan)
        self.plans.append(plan)
        out = Outputs()
        for op in plan.kv:
            cache = self.caches[getattr(op, 'slot', getattr(op, 'dst', 0))]
            if isinstance(op, Admit):
                cache.apply(op.reuse, op.goal.request.session_id)
            elif isinstance(op, Park):
                op.goal.park = (cache.keys, [b[:, :, :cache.length].copy() for b in cache.buffers])
                cache.reset()
            elif isinstance(op, Unpark):
                keys, data = op.goal.park
                cache.take(keys, op.goal.request.session_id, data)
            elif isinstance(op, Move):
                src = self.caches[op.src]
                cache.take(src.keys, src.owner, src.buffers)
                src.reset()
        if plan.prefill is not None:
            step = plan.prefill
            self.caches[step.slot].append(step.keys)
            out.prefill_logits = self._logits(step.keys[-1])
        if plan.decode is not None:
            rows = plan.decode.goals
            out.decode_logits = np.stack([self._logits(t) for t in plan.decode.tokens])
            for row, goal in enumerate(rows):
                if goal is not None:
                    self.caches[row].append_token(plan.decode.tokens[row])
        return out

    @staticmethod
    def _logits(last_key):
        logits = np.zeros(VOCAB, np.float32)
        logits[(int(last_key) + 1) % VOCAB] = 1.0
        return logits

    def _check(self, plan: Plan) -> None:
        assert plan.prefill is None or plan.decode is None, 'two model calls in one plan'
        slots = len(self.caches)
        for op in plan.kv:
            for attr in ('slot', 'src', 'dst'):
                if hasattr(op, attr):
                    assert 0 <= getattr(op, attr) < slots
            goal = getattr(op, 'goal', None)
            assert goal is None or goal.uid not in self.ended, 'a KV move of an ended goal'
        if plan.decode is not None:
            rows = plan.decode.goals
            assert rows and rows[-1] is not None, 'a trailing idle row'
            # Rows below the last decoding one are occupied (prefilling) slots, never free.
            for row, goal in enumerate(rows):
                assert goal is None or goal.state is GoalState.DECODE
            assert all(g.uid not in self.ended for g in rows if g is not None)
        if plan.prefill is not None:
            assert plan.prefill.goal.uid not in self.ended


class Rig:
    def __init__(self, slots=2, chunk=4, reuse=True):
        self.caches = [KVCache([np.zeros((1, 1, CAP, 2), np.float32)], CAP)
                       for _ in range(slots)]
        self.executor = FakeExecutor(self.caches)
        self.sched = Scheduler(self.caches, lambda goal, request: FakeSequence(
            request, goal.output), chunk, prefix_reuse=reuse)

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
        # Occupied slots are contiguous from 0 after every decode plan's compaction.
        occupied = [i for i, g in enumerate(self.sched._slot) if g is not None]
        for i, goal in enumerate(self.sched._slot):
            if goal is not None:
                assert goal.slot == i and goal.state in (GoalState.PREFILL, GoalState.DECODE)
        assert len(set(occupied)) == len(occupied)


def test_plans_alternate_admission_and_decode_with_one_model_call_each():
    rig = Rig(slots=2)
    a = rig.goal(range(1, 10), max_tokens=3)
    plan, _ = rig.plan()
    assert [type(op) for op in plan.kv] == [Admit] and plan.prefill is not None
    assert (plan.prefill.start, plan.prefill.stop) == (0, 4) and plan.decode is None
    plan, _ = rig.plan()
    assert plan.prefill is None and plan.decode is None   # nothing decodes yet
    rig.drain()
    assert a.result.completion_tokens == 3 and a.state is GoalState.DONE
    assert a.output.token_ids() == [10, 11, 12]   # the fake's logits: last key + 1


def test_a_freed_slot_below_a_busy_one_is_filled_by_moving_the_goal_down():
    rig = Rig(slots=3, chunk=16)
    short = rig.goal([1, 2, 3], max_tokens=1)
    mid = rig.goal([4, 5, 6], max_tokens=30)
    high = rig.goal([7, 8, 9], max_tokens=30)
    while not short.done:
        rig.step()
    while high.state is not GoalState.DECODE or mid.state is not GoalState.DECODE:
        rig.step()
    rig.step()
    moves = [op for p in rig.executor.plans for op in p.kv if isinstance(op, Move)]
    assert moves and moves[0].goal is high and (moves[0].src, moves[0].dst) == (2, 0)
    decode = next(p.decode for p in reversed(rig.executor.plans) if p.decode is not None)
    assert len(decode.goals) == 2 and None not in decode.goals   # no idle row computed
    # The moved goal's KV bookkeeping moved with it.
    assert rig.caches[0].keys[:3] == (7, 8, 9) and rig.caches[2].length == 0
    rig.drain()
    assert [g.result.completion_tokens for g in (short, mid, high)] == [1, 30, 30]


def test_priority_then_arrival_and_preemption_parks_then_unparks():
    rig = Rig(slots=1)
    low = rig.goal([1, 2], max_tokens=20)
    rig.step()
    rig.step()
    waiting = rig.goal([3], max_tokens=2, priority=0)
    urgent = rig.goal([4, 5], max_tokens=2, priority=5, preempt=True)
    plan, report = rig.plan()
    assert [type(op) for op in plan.kv] == [Park, Admit]
    assert plan.kv[0].goal is low and report.paused == [low] and low.state is GoalState.PAUSED
    assert plan.prefill.goal is urgent and urgent.slot == 0
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
    rig.drain()
    assert a.result.completion_tokens == 5


@pytest.mark.parametrize('seed', [1, 2, 3])
def test_random_storm_loses_nothing(seed):
    rng = random.Random(seed)
    rig = Rig(slots=3, chunk=3)
    goals = []
    for _ in range(400):
        if len(goals) < 50 and rng.random() < 0.3:
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
