"""Continuous batching: the scheduler plans, the executor runs (docs/batching.md).

The scheduler owns the engine's N sequence slots and the goals waiting for one. It never calls
a model and never moves KV bytes: it decides, and says so in a Plan. Its owner (the engine's
thread) repeats

    plan = scheduler.schedule()            # KV moves, then the rows of one model call
    outputs = executor.run(plan)           # serving/executor.py: runs them on the decoder
    report = scheduler.update(plan, outputs)   # advances the goals from the logits

(serving/loop.py). Every plan has one kind, the llama.cpp way (its update_slots):

1. end the goals whose cancel was asked, and run the end ops of goals that ended;
2. admit goals into the lowest free slots (a paused one before a waiting one of its own
   priority, else the head of the queue: priority then arrival; when every slot is busy and
   the head may preempt, pause the lowest-priority running goal below it, latest arrival
   among equals);
3. the rows of the step's one model call: first a DecodeRow for every decoding goal (one
   token, plus the drafts the executor adds when its sequence speculates: a verify row),
   then PrefillRows of prefilling goals, most urgent first, within the prefill budget
   (`prefill_chunk` prompt positions per step).

After a verify row, the positions of rejected drafts are forgotten by a Rewind before the next
call. Drafting (which may run a draft model), session-store reads and image encoding are the
executor's or the goal's preparation, never the plan's.

A new goal reuses the longest prefix of its prompt found in any slot's live KV or in a saved
session snapshot (runtime/kv_cache.py); a paused goal's KV is parked whole and restored into
whichever slot frees first, so it resumes without recomputation. Every submitted goal ends
exactly once: its result is set and it is in some report's `ended`, or, cancelled while it
waited, `cancel()` ends it and returns True.

Threading: submit, cancel and waiting may be called from any thread; everything else only from
the owner's thread.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime import media
from edge_llm_ros.runtime.kv_cache import KVCache, Reuse
from edge_llm_ros.runtime.sequence import RECOMPUTE
from edge_llm_ros.runtime.types import GenerationResult, StopReason
from edge_llm_ros.serving.goal import (CancelReason, error_result, Goal, GoalState, PRIORITY_MAX,
                                       PRIORITY_MIN)
from edge_llm_ros.serving.queue import GoalQueue, WaitQueue

__all__ = ['Admit', 'Checkpoint', 'Commit', 'DecodeRow', 'Outputs', 'Park', 'Plan',
           'PrefillRow', 'PRIORITY_MAX', 'PRIORITY_MIN', 'Report', 'Rewind', 'Scheduler',
           'Start', 'Unpark']


# --- what a plan asks the executor to do -------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """Build the goal's runtime Sequence: its session's turns bound, its images encoded.

    The goal holds `slot` from now on; the next plan admits its prompt's KV there.
    """

    goal: Goal
    slot: int


@dataclass(frozen=True)
class Admit:
    """Make `reuse` live in `slot` for the goal's session (fresh: forget the slot first)."""

    goal: Goal
    slot: int
    reuse: Reuse
    fresh: bool = False


@dataclass(frozen=True)
class Park:
    """Copy the slot's positions into goal.park and empty the slot (the goal pauses)."""

    goal: Goal
    slot: int


@dataclass(frozen=True)
class Unpark:
    """Copy goal.park back into `slot` (the goal resumes)."""

    goal: Goal
    slot: int


@dataclass(frozen=True)
class Rewind:
    """Forget the slot's positions from `length` on (drafts a verify pass rejected)."""

    slot: int
    length: int


@dataclass(frozen=True)
class Checkpoint:
    """Persist the slot's session now (a goal ended there; no-op without sessions.store)."""

    slot: int


@dataclass(frozen=True)
class Commit:
    """Keep a session's conversation after a turn that ended in `slot` (with its KV)."""

    slot: int
    session_id: str
    conversation: Any       # runtime.conversation.Conversation


KVOp = Union[Start, Admit, Park, Unpark, Rewind, Checkpoint, Commit]


@dataclass(frozen=True)
class PrefillRow:
    """Prompt positions start..stop-1 of the goal, in its slot: ids after embeds.

    last: the prompt's last piece; its last position's logits start the goal's output.
    """

    goal: Goal
    start: int
    stop: int
    ids: np.ndarray
    embeds: Optional[np.ndarray]
    keys: tuple
    bidirectional: bool = False   # exactly one image whose rows see each other both ways
    last: bool = False


@dataclass(frozen=True)
class DecodeRow:
    """The goal's next token at `position`; room > 0: the executor may add that many drafts.

    replay: tokens fed again first, at position - len(replay).. (a conv state cannot be cut
    back to an accepted draft: it was rewound to the verify's start instead).
    """

    goal: Goal
    token: int
    position: int
    room: int = 0
    replay: Tuple[int, ...] = ()

    @property
    def start(self) -> int:
        return self.position - len(self.replay)


StepRow = Union[DecodeRow, PrefillRow]


@dataclass
class Plan:
    """One schedule() call: KV moves in order, then the rows of at most one model call."""

    kv: List[KVOp] = field(default_factory=list)
    rows: List[StepRow] = field(default_factory=list)
    ended: List[Goal] = field(default_factory=list)    # ended without a model call
    paused: List[Goal] = field(default_factory=list)
    resumed: List[Goal] = field(default_factory=list)
    started: List[Goal] = field(default_factory=list)  # left the queue for a slot

    @property
    def empty(self) -> bool:
        return not (self.kv or self.rows or self.ended or self.paused or self.resumed
                    or self.started)


@dataclass
class Outputs:
    """What the executor returns for a plan (logits are views valid until its next run)."""

    failed: Dict[int, BaseException] = field(default_factory=dict)   # goal.uid -> KV op error
    # Per plan row: the logits of the positions it asked for ([n, vocab]; None: not run).
    logits: List[Optional[np.ndarray]] = field(default_factory=list)
    drafts: Dict[int, Tuple[int, ...]] = field(default_factory=dict)   # row index -> drafts
    started: float = 0.0      # perf_counter when the step's work began (drafting included)
    seconds: float = 0.0      # the step's time
    error: Optional[BaseException] = None   # the model call failed for every row in it


@dataclass
class Report:
    """What a plan did to the goals: started, new tokens, paused, resumed, ended."""

    tokens: List[Goal] = field(default_factory=list)
    paused: List[Goal] = field(default_factory=list)
    resumed: List[Goal] = field(default_factory=list)
    ended: List[Goal] = field(default_factory=list)
    started: List[Goal] = field(default_factory=list)

    def __iadd__(self, other: 'Report') -> 'Report':
        self.tokens += other.tokens
        self.paused += other.paused
        self.resumed += other.resumed
        self.ended += other.ended
        self.started += other.started
        return self


# What to do with a goal's slot when it ends there (Engine._end_ops): its checkpoint, or its
# session's committed turn.
EndOps = Callable[[Goal, int], List[KVOp]]


def checkpoint_only(goal: Goal, slot: int) -> List[KVOp]:
    return [Checkpoint(slot)]


class Scheduler:
    """N slots over one decoder's KV caches; see the module docstring."""

    def __init__(self, caches: Sequence[KVCache], prefill_chunk: int, prefix_reuse: bool = True,
                 recompute: int = RECOMPUTE, end_ops: EndOps = checkpoint_only,
                 on_end: Optional[Callable[[Goal], None]] = None) -> None:
        """Plan over `caches` (one per slot, read here; the executor writes them).

        :param prefill_chunk: prompt positions per prefill call.
        :param recompute: prompt positions always prefilled again on prefix reuse.
        :param end_ops: (goal, slot) -> the KV ops that follow a goal's end in its slot.
        :param on_end: called with every goal that ends, in a slot, paused or failed at its
            start alike (Engine._goal_ended frees the goal's adapters there).
        """
        self._caches = list(caches)
        self.slots = len(self._caches)
        self._chunk = prefill_chunk
        self._prefix_reuse = prefix_reuse
        self._recompute = recompute
        self._end_ops = end_ops
        self._on_end = on_end
        self._queue = GoalQueue()
        self._slot: List[Optional[Goal]] = [None] * self.slots
        self._paused: List[Goal] = []
        self._deferred: List[KVOp] = []   # checkpoints of goals ended in update()

    # --- any thread ----------------------------------------------------------------------------
    def submit(self, goal: Goal) -> Goal:
        """Queue a goal; one that was cancelled before it is ended at once (goal.done)."""
        return self._queue.submit(goal)

    def cancel(self, goal: Goal, reason: CancelReason = CancelReason.CLIENT) -> bool:
        """Cancel a goal: a waiting one ends here (True), a running or paused one later.

        A running or paused goal ends at the next plan, whose report carries it.
        """
        return self._queue.cancel(goal, reason)

    def waiting(self) -> List[Goal]:
        return self._queue.waiting()

    def take_waiting(self) -> List[Goal]:
        """Remove the waiting goals, unsubmitted (any thread; GoalQueue.take_all)."""
        return self._queue.take_all()

    # --- owner thread: state -------------------------------------------------------------------
    def live(self) -> List[Goal]:
        """Goals holding a slot (prefilling or decoding)."""
        return [g for g in self._slot if g is not None]

    def paused(self) -> List[Goal]:
        return list(self._paused)

    def busy(self) -> bool:
        """Tell whether a goal holds a slot (its KV is in the live buffers)."""
        return any(g is not None for g in self._slot)

    def has_work(self, admit: bool = True) -> bool:
        if self.busy() or self._deferred or any(g.cancelled for g in self._paused):
            return True
        return admit and (bool(self._paused) or bool(len(self._queue)))

    def idle(self) -> bool:
        return not self.busy() and not self._paused and not len(self._queue) \
            and not self._deferred

    # --- owner thread: planning ----------------------------------------------------------------
    def schedule(self, admit: bool = True) -> Plan:
        """Return the next plan: ends, admissions, then the rows of one model call.

        admit False drains: nothing new is admitted or resumed.
        """
        plan = self.reap_plan()   # its checkpoints run before anything overwrites the slots
        # A slot whose rejected drafts are forgotten first is no prefix source yet.
        touched = {op.slot for op in plan.kv if isinstance(op, Rewind)}
        for goal in self._slot:   # goals whose Sequence the last plan's Start built
            if goal is not None and goal.chunks is None and goal.sequence is not None:
                self._admit_kv(goal, plan, touched)
        if admit:
            self._admit(plan, touched)
        self._plan_rows(plan)
        return plan

    def _admit(self, plan: Plan, touched: Set[int]) -> None:
        while True:
            free = [i for i, g in enumerate(self._slot) if g is None]
            paused = min(self._paused, key=WaitQueue.key, default=None)
            # A session's turns run one after the other: its next goal waits for the last.
            busy = {_session(g) for g in self.live() + self._paused} - {''}
            head = self._queue.first(lambda g: _session(g) not in busy)
            # A paused goal goes before waiting ones of its own priority.
            take_paused = paused is not None and (head is None
                                                  or paused.priority >= head.priority)
            if not free:
                if take_paused or head is None or not head.preempt:
                    return
                victim = self._victim(head.priority)
                if victim is None:
                    return   # nothing preemptible: the head waits (documented, not an error)
                self._pause(victim, plan, touched)
                continue
            slot = free[0]
            if take_paused:
                self._resume(paused, slot, plan, touched)
                continue
            if head is None:
                return
            if self._queue.take(head):   # else it was cancelled meanwhile: look again
                self._admit_new(head, slot, plan, touched)

    def _victim(self, priority: int) -> Optional[Goal]:
        """Return the running goal of lowest priority below `priority` (latest arrival).

        A goal still starting (its KV not admitted yet) is not one: it holds no positions.
        """
        lower = [g for g in self.live() if g.priority < priority and g.chunks is not None]
        return min(lower, key=lambda g: (g.priority, -g.arrival), default=None)

    def _admit_new(self, goal: Goal, slot: int, plan: Plan, touched: Set[int]) -> None:
        """Give the goal a slot; the executor builds its Sequence (Start)."""
        goal.queue_wait_s = goal.wait_time()
        plan.started.append(goal)
        goal.slot, goal.state = slot, GoalState.PREFILL
        self._slot[slot] = goal
        plan.kv.append(Start(goal, slot))

    def _admit_kv(self, goal: Goal, plan: Plan, touched: Set[int]) -> None:
        """Make the longest reusable prefix of a started goal's prompt live in its slot."""
        request = goal.sequence.request
        slot = goal.slot
        keys = request.cache_keys
        reuse = Reuse(0)
        if self._prefix_reuse:
            # A slot an earlier op of this plan changes is no source: its keys will differ.
            others = [c for i, c in enumerate(self._caches) if i not in touched]
            limit = max(len(keys) - self._recompute, 0)
            reuse = self._caches[slot].find_reuse(keys, request.key_hashes, limit, others,
                                                  own=slot not in touched)
            floor = media.span_floor(request.spans, reuse.length) if request.whole_spans \
                else reuse.length
            if floor != reuse.length:   # a bidirectional image is prefilled whole
                reuse = self._caches[slot].find_reuse(keys, request.key_hashes, floor, others,
                                                      own=slot not in touched)
        touched.add(slot)
        plan.kv.append(Admit(goal, slot, reuse, fresh=not self._prefix_reuse))
        goal.chunks = collections.deque(goal.sequence.chunks(reuse.length, self._chunk))

    def _pause(self, goal: Goal, plan: Plan, touched: Set[int]) -> None:
        """Park the goal's KV (a copy of its positions) and free its slot."""
        plan.kv.append(Park(goal, goal.slot))
        touched.add(goal.slot)
        self._slot[goal.slot] = None
        goal.slot = -1
        goal.resume_state, goal.state = goal.state, GoalState.PAUSED
        self._paused.append(goal)
        plan.paused.append(goal)

    def _resume(self, goal: Goal, slot: int, plan: Plan, touched: Set[int]) -> None:
        """Copy the parked KV into a free slot; the goal goes on where it stopped."""
        plan.kv.append(Unpark(goal, slot))
        touched.add(slot)
        self._paused.remove(goal)
        goal.slot, goal.state = slot, goal.resume_state
        self._slot[slot] = goal
        plan.resumed.append(goal)

    def _plan_rows(self, plan: Plan) -> None:
        """Decode rows of every decoding goal, then prompt pieces within the prefill budget."""
        for goal in self._slot:
            if goal is not None and goal.state is GoalState.DECODE:
                seq = goal.sequence
                room = self._caches[goal.slot].capacity - seq.pos - 1
                plan.rows.append(DecodeRow(goal, seq.token, seq.pos, room, goal.replay))
                goal.replay = ()
        pending = sorted((g for g in self._slot if g is not None
                          and g.state is GoalState.PREFILL and g.chunks),
                         key=WaitQueue.key)
        budget = self._chunk
        for goal in pending:
            if budget == 0:
                return
            a, b = goal.chunks.popleft()
            seq = goal.sequence
            whole = seq.whole_span(a, b)   # an image seen both ways is one row, whatever
            if whole and b - a > budget and budget < self._chunk:
                goal.chunks.appendleft((a, b))   # it waits for a step of its own
                continue
            if not whole and b - a > budget:
                goal.chunks.appendleft((a + budget, b))
                b = a + budget
            budget = max(budget - (b - a), 0)
            ids, embeds = seq.prefill_inputs(a, b)
            plan.rows.append(PrefillRow(goal, a, b, ids, embeds,
                                        tuple(seq.request.cache_keys[a:b]), whole,
                                        last=not goal.chunks))

    # --- owner thread: advancing ---------------------------------------------------------------
    def update(self, plan: Plan, outputs: Outputs) -> Report:
        """Advance the goals from the executor's outputs for `plan`; return what changed."""
        report = Report(paused=plan.paused, resumed=plan.resumed, ended=list(plan.ended),
                        started=plan.started)
        for op in plan.kv:
            goal = getattr(op, 'goal', None)
            if goal is None or goal.uid not in outputs.failed or goal.done:
                continue
            exc = outputs.failed[goal.uid]
            if isinstance(op, Start):
                # Validated at admission; what only running can find (a stale embeddings
                # handle). Its slot holds nothing of it: no end ops.
                goal.refused = isinstance(exc, InvalidRequestError)
                self._slot[goal.slot], goal.slot = None, -1
                self._end(goal, report.ended,
                          error=str(exc) if goal.refused else f'{type(exc).__name__}: {exc}')
            else:
                self._end(goal, report.ended, exc=exc)
        for i, row in enumerate(plan.rows):
            goal = row.goal
            if goal.done:
                continue
            if outputs.error is not None:   # the call failed for every row in it
                self._end(goal, report.ended, exc=outputs.error)
            elif isinstance(row, PrefillRow):
                self._prefilled(row, outputs.logits[i], outputs.seconds, report)
            else:
                self._decoded(row, outputs.logits[i], outputs.drafts.get(i, ()),
                              outputs.started, report)
        return report

    def _prefilled(self, row: PrefillRow, logits: Optional[np.ndarray], seconds: float,
                   report: Report) -> None:
        goal = row.goal
        seq = goal.sequence
        seq.prefilled(row.start, row.stop, seconds)
        if not row.last:
            return
        cache = self._caches[goal.slot]
        try:
            event = seq.start(logits[-1], cache.length, cache.room())
        except Exception as exc:  # noqa: B902 - ends this goal only
            self._end(goal, report.ended, exc=exc)
            return
        goal.state = GoalState.DECODE
        if event is not None:
            report.tokens.append(goal)
        if seq.done:
            self._end(goal, report.ended)

    def _decoded(self, row: DecodeRow, logits: np.ndarray, draft: Tuple[int, ...],
                 started: float, report: Report) -> None:
        """Advance a decode row's goal (a verify row: forget the rejected drafts' positions)."""
        goal = row.goal
        seq = goal.sequence
        try:
            if draft:
                seq.advance_verified(logits, draft, started)
            else:
                seq.advance(logits[0], started)
        except Exception as exc:  # noqa: B902 - ends this goal only
            if draft:
                self._deferred.append(Rewind(goal.slot, row.start))
            self._end(goal, report.ended, exc=exc)
            return
        if draft and seq.pos < row.position + len(draft) + 1:   # drafts were rejected
            if self._caches[goal.slot].rewindable:
                self._deferred.append(Rewind(goal.slot, seq.pos))
            else:
                # Back to the verify's start (its conv states were kept), and the accepted
                # tokens go again in front of the next one.
                self._deferred.append(Rewind(goal.slot, row.start))
                goal.replay = (row.replay + (row.token,) + draft)[:seq.pos - row.start]
        report.tokens.append(goal)
        if seq.done:
            self._end(goal, report.ended)

    def _end(self, goal: Goal, ended: List[Goal], reason: Optional[StopReason] = None,
             exc: Optional[BaseException] = None, error: str = '') -> None:
        """End a goal now: its result, its slot freed (its end ops deferred to settle())."""
        if exc is not None:
            error = f'{type(exc).__name__}: {exc}'
        seq = goal.sequence
        result: GenerationResult
        if seq is not None:
            result = seq.finish(reason, error)
        else:
            result = error_result(error)
        if goal.state is GoalState.PAUSED:
            self._paused.remove(goal)
        elif goal.slot >= 0:
            self._deferred += self._end_ops(goal, goal.slot)
            self._slot[goal.slot] = None
        goal.slot = -1
        if self._on_end is not None:
            self._on_end(goal)
        goal.finish(replace(result, timings=replace(result.timings,
                                                    queue_wait_s=goal.queue_wait_s)))
        ended.append(goal)

    def settle(self) -> Optional[Plan]:
        """Return the end ops of the goals update() ended (None: none), to run at once.

        StepLoop runs them before the report leaves the lock, so a session's committed turn
        is stored before its next goal is bound or anyone reads the session.
        """
        if not self._deferred:
            return None
        plan = Plan()
        plan.kv, self._deferred = self._deferred, []
        return plan

    def reap_plan(self) -> Plan:
        """End the goals whose cancel was asked now; return a plan with their checkpoints.

        The owner runs it through the executor (and update(), for the report) like any other.
        """
        plan = Plan()
        for goal in self.live() + self._paused:
            if goal.cancelled:
                self._end(goal, plan.ended, StopReason.CANCELLED)
        plan.kv, self._deferred = self._deferred, []
        return plan

    def abort(self, reason: CancelReason = CancelReason.SHUTDOWN) -> Plan:
        """Cancel every goal (waiting ones end at once); return the plan that ends the rest."""
        for goal in self.live() + self._paused + self.waiting():
            self.cancel(goal, reason)
        return self.reap_plan()


def _session(goal: Goal) -> str:
    """Return the conversation a goal continues ('' = none): its goals run one at a time."""
    request = goal.request
    return request.session_id if getattr(request, 'chat', None) is not None else ''
