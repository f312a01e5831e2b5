"""Continuous batching: sequence slots, a priority queue and preemption (docs/batching.md).

A scheduler owns the engine's N sequence slots and the sequences waiting for one. Its owner
(the worker thread) calls ``step()`` in a loop; each step

1. ends the sequences whose cancel was asked (waiting, prefilling, decoding or paused),
2. admits sequences into free slots: a paused one before a waiting one of its own priority,
   else the head of the queue (priority, then arrival); when every slot is busy and the head
   may preempt, pauses the lowest-priority running sequence below it (latest arrival among
   equals) and gives the head its slot,
3. runs at most one prefill chunk (``prefill_chunk`` positions) of one admitted sequence,
4. runs one decode step of every decoding sequence in one model call,

and returns the step's events in order: tokens, paused/resumed, results. Every submitted
sequence gets exactly one result event (or, when cancelled while waiting, its result from
``cancel``).

Threading: ``submit``, ``cancel`` and ``waiting`` may be called from any thread; ``step`` only
from the owner's thread. A paused sequence's KV is copied out of its slot ("parked") and copied
back, whole, into whichever slot frees first: it resumes without recomputation.

``SerialScheduler`` runs the same queue and events over any engine whose ``generate`` returns
an iterator of TokenEvent (the remote backend, test fakes): one sequence at a time, no
preemption (a preempting head waits like any other).
"""
from __future__ import annotations

import bisect
import collections
import contextlib
from dataclasses import dataclass, field
import enum
import itertools
import threading
import time
from typing import Any, Callable, ContextManager, Deque, List, Optional, Sequence as Seq

import numpy as np

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.kv_cache import common_prefix, KVCache
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings, TokenEvent

PRIORITY_MIN, PRIORITY_MAX = -100, 100
# Rows of a batched decode step when the engine has N > 1 slots: onnxruntime's MatMulNBits
# takes another kernel for one row (M=1) than for several, and at float accuracy levels the
# two differ in the last bits (measured: ~3e-5 on logits at accuracy level 0). Rows >= 2 are
# bit-identical whatever their count, so a sequence alone and the same one in a batch agree
# exactly. At accuracy level 4 (int8 activations) M=1 and M>=2 measured bit-identical, and the
# padding row would cost ~20 % of a lone sequence's speed: min_rows_for() gives 1 there.
MIN_ROWS = 2


def min_rows_for(accuracy_level: Optional[int]) -> int:
    """Return the fewest rows a batched decode step runs for a model of this accuracy level."""
    return 1 if accuracy_level == 4 else MIN_ROWS


class SeqState(str, enum.Enum):
    WAITING = 'waiting'
    PREFILL = 'prefill'
    DECODE = 'decode'
    PAUSED = 'paused'
    DONE = 'done'


LIVE = (SeqState.PREFILL, SeqState.DECODE)


@dataclass(eq=False)
class Sequence:
    """One request through the scheduler; `tag` is the caller's (the worker's Job)."""

    request: Any                     # PreparedRequest (or what the engine's generate takes)
    priority: int = 0
    preempt: bool = False
    # Entered at admission on the stepping thread, left when the sequence ends; yields the
    # prefix-embedding array to bind into the request.
    embeddings: Optional[Callable[[], ContextManager[np.ndarray]]] = None
    tag: Any = None
    state: SeqState = field(default=SeqState.WAITING, init=False)
    arrival: int = field(default=0, init=False)
    submitted_at: float = field(default=0.0, init=False)   # time.monotonic()
    queue_wait_s: float = field(default=0.0, init=False)
    result: Optional[GenerationResult] = field(default=None, init=False)
    slot: int = field(default=-1, init=False)
    generation: Any = field(default=None, init=False, repr=False)
    cancel_asked: bool = False        # cancel() was called (or it is submitted cancelled)
    _chunks: Optional[Deque] = field(default=None, init=False, repr=False)
    _park: Any = field(default=None, init=False, repr=False)
    _resume_state: SeqState = field(default=SeqState.DECODE, init=False, repr=False)
    _exit: Optional[contextlib.ExitStack] = field(default=None, init=False, repr=False)


@dataclass(frozen=True)
class SeqEvent:
    """What a step did to one sequence: a token, paused (True) / resumed (False), or done."""

    seq: Sequence
    token: Optional[TokenEvent] = None
    paused: Optional[bool] = None
    result: Optional[GenerationResult] = None


def cancelled_result(text: str = '', token_ids=(), prompt_tokens: int = 0,
                     timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text=text, token_ids=list(token_ids),
                            stop_reason=StopReason.CANCELLED, prompt_tokens=prompt_tokens,
                            completion_tokens=len(token_ids), timings=timings)


def error_result(message: str, timings: Timings = Timings()) -> GenerationResult:
    return GenerationResult(text='', token_ids=[], stop_reason=StopReason.ERROR,
                            prompt_tokens=0, completion_tokens=0, timings=timings,
                            error=message)


def check_priority(priority: int) -> None:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
            or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f'priority must be an integer in {PRIORITY_MIN}..{PRIORITY_MAX}, '
                         f'got {priority!r}')


class WaitQueue:
    """Waiting sequences, highest priority first, then arrival (not thread-safe)."""

    def __init__(self) -> None:
        self._keys: List[tuple] = []
        self._items: List[Sequence] = []

    @staticmethod
    def key(seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival)

    def push(self, seq: Sequence) -> None:
        i = bisect.bisect(self._keys, self.key(seq))
        self._keys.insert(i, self.key(seq))
        self._items.insert(i, seq)

    def head(self) -> Optional[Sequence]:
        return self._items[0] if self._items else None

    def pop(self) -> Sequence:
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, seq: Sequence) -> bool:
        for i, item in enumerate(self._items):
            if item is seq:
                del self._keys[i]
                del self._items[i]
                return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> List[Sequence]:
        return list(self._items)


class _Base:
    """Queue, submission and cancel shared by both schedulers."""

    slots = 1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue = WaitQueue()
        self._arrivals = itertools.count()

    def submit(self, seq: Sequence) -> Sequence:
        """Queue a sequence (any thread); ValueError for a priority out of range."""
        check_priority(seq.priority)
        with self._lock:
            if seq.state is not SeqState.WAITING or seq.submitted_at:
                raise ValueError('a sequence can be submitted once')
            seq.arrival = next(self._arrivals)
            seq.submitted_at = time.monotonic()
            self._queue.push(seq)
        return seq

    def cancel(self, seq: Sequence) -> bool:
        """Cancel a sequence (any thread).

        A waiting one ends here: its result is set and True returned (no event will come).
        A running or paused one stops at the next step, which reports its result.
        """
        with self._lock:
            if seq.state is SeqState.WAITING and self._queue.remove(seq):
                seq.state = SeqState.DONE
                seq.result = cancelled_result(
                    timings=Timings(queue_wait_s=time.monotonic() - seq.submitted_at))
                return True
            seq.cancel_asked = True
            generation = seq.generation
        if generation is not None:
            generation.cancel()
        return False

    def waiting(self) -> List[Sequence]:
        """Return the waiting sequences in the order they will be admitted."""
        with self._lock:
            return self._queue.items()

    def _pop_head(self) -> Optional[Sequence]:
        with self._lock:
            return self._queue.pop() if len(self._queue) else None

    def _start(self, seq: Sequence, make: Callable[[Any], Any]) -> Optional[SeqEvent]:
        """Enter the embeddings, bind and create the generation; an error ends the sequence."""
        seq.queue_wait_s = time.monotonic() - seq.submitted_at
        stack = contextlib.ExitStack()
        try:
            request = seq.request
            if seq.embeddings is not None:
                request = request.bind(stack.enter_context(seq.embeddings()))
            generation = make(request)
        except Exception as exc:  # noqa: B902 - one bad request must not stop the others
            stack.close()
            # Validated at admission; what only running can find (a stale embeddings handle).
            text = str(exc) if isinstance(exc, InvalidRequestError) else \
                f'{type(exc).__name__}: {exc}'
            return self._done(seq, error_result(text))
        with self._lock:
            seq.generation = generation
            cancel = seq.cancel_asked
        if cancel:
            generation.cancel()
        seq._exit = stack
        return None

    def _done(self, seq: Sequence, result: GenerationResult) -> SeqEvent:
        if seq._exit is not None:
            stack, seq._exit = seq._exit, None
            try:
                stack.close()   # releases the prefix embeddings (llm_node: the mapped frames)
            except Exception as exc:  # noqa: B902 - this sequence's problem, not the step's
                result = error_result(f'releasing the prefix embeddings failed: '
                                      f'{type(exc).__name__}: {exc}', result.timings)
        seq.state = SeqState.DONE
        seq.result = result
        seq.generation = None
        return SeqEvent(seq, result=result)


class BatchScheduler(_Base):
    """N slots over one OnnxDecoder; see the module docstring."""

    def __init__(self, decoder, caches: Seq[KVCache],
                 new_generation: Callable[[Any, KVCache, int], Any],
                 lock: threading.RLock, prefix_reuse: bool = True,
                 min_rows: int = MIN_ROWS) -> None:
        """Schedule over the decoder's slots.

        :param caches: one KVCache per slot (sharing one SnapshotStore).
        :param new_generation: (prepared request, cache, slot) -> Generation.
        :param lock: the engine's lock, held during each step.
        :param min_rows: fewest rows of a batched decode step (see min_rows_for).
        """
        super().__init__()
        self._decoder = decoder
        self._caches = list(caches)
        self.slots = len(self._caches)
        self._new = new_generation
        self._engine_lock = lock
        self._prefix_reuse = prefix_reuse
        self._slot: List[Optional[Sequence]] = [None] * self.slots
        self._paused: List[Sequence] = []
        # Rows of a batched step; N = 1 keeps the single-row decode path.
        self._rows = (lambda b: max(b, min_rows)) if self.slots > 1 else None

    # --- state -------------------------------------------------------------------------------
    def live(self) -> List[Sequence]:
        """Sequences holding a slot (prefilling or decoding)."""
        return [s for s in self._slot if s is not None]

    def paused(self) -> List[Sequence]:
        return list(self._paused)

    def busy(self) -> bool:
        """Tell whether a sequence holds a slot (its KV is in the live buffers)."""
        return any(s is not None for s in self._slot)

    def has_work(self, admit: bool = True) -> bool:
        if self.busy() or any(s.cancel_asked for s in self._paused):
            return True
        return admit and (bool(self._paused) or bool(len(self._queue)))

    def idle(self) -> bool:
        return not self.busy() and not self._paused and not len(self._queue)

    # --- the step ----------------------------------------------------------------------------
    def step(self, admit: bool = True,
             emit: Optional[Callable[[List[SeqEvent]], None]] = None) -> List[SeqEvent]:
        """Run one scheduling step on the owner thread (admit False: drain, admit nothing).

        Returns the step's events; with `emit`, the events up to the prefill (a new
        sequence's first token) go to emit(events) before the batched decode runs, so that
        first token is not held back by the others' step.
        """
        events: List[SeqEvent] = []
        with self._engine_lock:
            self._reap(events)
            if admit:
                self._admit(events)
            self._prefill_one(events)
        if emit is not None and events:
            emit(events)
            events = []
        with self._engine_lock:
            self._decode(events)
        return events

    def _reap(self, events: List[SeqEvent]) -> None:
        for seq in self.live() + self._paused:
            if seq.cancel_asked:
                self._end(seq, events, StopReason.CANCELLED)

    def _end(self, seq: Sequence, events: List[SeqEvent],
             reason: Optional[StopReason] = None, exc: Optional[BaseException] = None) -> None:
        gen = seq.generation
        if exc is not None:
            gen.fail(exc)
        else:
            gen.end(reason)
        if seq.state is SeqState.PAUSED:
            self._paused.remove(seq)
            seq._park = None
        else:
            self._caches[seq.slot].checkpoint()  # persisted sessions: this turn goes to disk
            self._slot[seq.slot] = None
        events.append(self._done(seq, gen.result))

    # --- admission and preemption ------------------------------------------------------------
    def _admit(self, events: List[SeqEvent]) -> None:
        while True:
            free = [i for i, s in enumerate(self._slot) if s is None]
            paused = min(self._paused, key=WaitQueue.key, default=None)
            with self._lock:
                head = self._queue.head()
            # A paused sequence goes before waiting ones of its own priority.
            take_paused = paused is not None and (head is None
                                                  or paused.priority >= head.priority)
            if not free:
                if take_paused or head is None or not head.preempt:
                    return
                victim = self._victim(head.priority)
                if victim is None:
                    return   # nothing preemptible: the head waits (documented, not an error)
                self._pause(victim, events)
                continue
            if take_paused:
                self._resume(paused, free, events)
                continue
            seq = self._pop_head()
            if seq is None:
                return
            self._admit_new(seq, free, events)

    def _victim(self, priority: int) -> Optional[Sequence]:
        """Return the running sequence of lowest priority below `priority` (latest arrival)."""
        lower = [s for s in self.live() if s.priority < priority]
        return min(lower, key=lambda s: (s.priority, -s.arrival), default=None)

    def _pick_slot(self, seq: Sequence, free: List[int]) -> int:
        """Free slot whose live KV shares the longest prefix with the request (lowest index)."""
        keys = seq.request.keys
        best, best_n = free[0], 0
        for i in free:
            n = common_prefix(self._caches[i].keys, keys)
            if n > best_n:
                best, best_n = i, n
        return best

    def _admit_new(self, seq: Sequence, free: List[int], events: List[SeqEvent]) -> None:
        slot = self._pick_slot(seq, free)
        cache = self._caches[slot]

        def make(request):
            return self._new(request, cache, slot)
        failed = self._start(seq, make)
        if failed is not None:
            events.append(failed)
            return
        seq.slot = slot
        seq.state = SeqState.PREFILL
        self._slot[slot] = seq
        if seq.cancel_asked:
            return   # reaped next step, before any model call
        try:
            if not self._prefix_reuse:
                cache.reset()
            seq._chunks = collections.deque(seq.generation.begin())
        except Exception as exc:  # noqa: B902 - ends this sequence only
            self._end(seq, events, exc=exc)

    def _pause(self, seq: Sequence, events: List[SeqEvent]) -> None:
        """Park the sequence's KV (a copy of its positions) and free its slot."""
        cache = self._caches[seq.slot]
        n = cache.length
        data = [buf[:, :, :n].copy() for buf in self._decoder.slot_buffers(seq.slot)]
        seq._park = (cache.keys, data)
        cache.reset()   # its positions live in the park now; nothing to save as a session
        self._slot[seq.slot] = None
        seq.slot = -1
        seq._resume_state = seq.state
        seq.state = SeqState.PAUSED
        self._paused.append(seq)
        events.append(SeqEvent(seq, paused=True))

    def _resume(self, seq: Sequence, free: List[int], events: List[SeqEvent]) -> None:
        """Copy the parked KV into a free slot; the sequence goes on where it stopped."""
        slot = free[0]
        cache = self._caches[slot]
        keys, data = seq._park
        # recompute=len: nothing reused, but the slot's unsaved session prefix (if any) is
        # saved before being overwritten, and the cache is owned by this session.
        cache.plan(keys or (0,), seq.request.session_id, recompute=max(len(keys), 1))
        for buf, parked in zip(self._decoder.slot_buffers(slot), data):
            buf[:, :, :len(keys)] = parked
        cache.append(keys)
        seq.generation.move_to(cache, slot)
        seq._park = None
        self._paused.remove(seq)
        seq.slot = slot
        seq.state = seq._resume_state
        self._slot[slot] = seq
        events.append(SeqEvent(seq, paused=False))

    # --- model calls -------------------------------------------------------------------------
    def _prefill_one(self, events: List[SeqEvent]) -> None:
        """One prompt chunk of the most urgent prefilling sequence."""
        pending = [s for s in self._slot if s is not None and s.state is SeqState.PREFILL]
        if not pending:
            return
        seq = min(pending, key=WaitQueue.key)
        gen = seq.generation
        try:
            a, b = seq._chunks.popleft()
            logits = gen.prefill_chunk(a, b)
            if seq._chunks:
                return
            event = gen.first(logits)
        except Exception as exc:  # noqa: B902 - ends this sequence only
            self._end(seq, events, exc=exc)
            return
        seq.state = SeqState.DECODE
        if event is not None:
            events.append(SeqEvent(seq, token=event))
        if gen.done:
            self._end(seq, events)

    def _decode(self, events: List[SeqEvent]) -> None:
        """One token of every decoding sequence, in one model call."""
        slots = self._slot
        rows = [i for i, s in enumerate(slots) if s is not None and s.state is SeqState.DECODE]
        if not rows:
            return
        t = time.perf_counter()
        try:
            if self._rows is None:
                gen = slots[0].generation
                logits = self._decoder.decode(gen.token, gen.pos)[None, :]
            else:
                logits = self._decoder.decode_rows(*self._row_inputs(self._rows(rows[-1] + 1)))
        except Exception as exc:  # noqa: B902 - the call failed for every row in it
            for i in rows:
                self._end(slots[i], events, exc=exc)
            return
        for i in rows:
            seq = slots[i]
            try:
                event = seq.generation.advance(logits[i], t)
            except Exception as exc:  # noqa: B902 - ends this sequence only
                self._end(seq, events, exc=exc)
                continue
            events.append(SeqEvent(seq, token=event))
            if seq.generation.done:
                self._end(seq, events)

    def _row_inputs(self, count: int):
        """Tokens and positions of rows 0..count-1; an idle row writes past its kept KV."""
        tokens, positions = [0] * count, [0] * count
        for i in range(count):
            seq = self._slot[i]
            if seq is not None and seq.state is SeqState.DECODE:
                tokens[i], positions[i] = seq.generation.token, seq.generation.pos
                continue
            cache = self._caches[i]
            if cache.room() == 0:
                cache.rewind_to(cache.length - 1)   # a full idle slot gives up its last one
            positions[i] = cache.length
        return tokens, positions

    def abort(self) -> None:
        """End every running, paused and waiting sequence as CANCELLED (engine reset/close)."""
        for seq in self.live() + self._paused + self.waiting():
            self.cancel(seq)
        self._reap([])


class SerialScheduler(_Base):
    """One sequence at a time over any engine's ``generate`` (no batching, no preemption)."""

    def __init__(self, engine) -> None:
        super().__init__()
        self._engine = engine
        self._current: Optional[Sequence] = None
        self._events: Any = None   # iter() of the current generation (an iterable, at least)

    def live(self) -> List[Sequence]:
        return [self._current] if self._current is not None else []

    def paused(self) -> List[Sequence]:
        return []

    def busy(self) -> bool:
        return self._current is not None

    def has_work(self, admit: bool = True) -> bool:
        return self.busy() or (admit and bool(len(self._queue)))

    def idle(self) -> bool:
        return not self.busy() and not len(self._queue)

    def abort(self) -> None:
        """Forget the running sequence (its generation is cancelled) and the waiting ones."""
        for seq in self.live() + self.waiting():
            self.cancel(seq)
        if self._current is not None:
            self._done(self._current, cancelled_result())
            self._current = None

    def step(self, admit: bool = True, emit=None) -> List[SeqEvent]:
        """Admit the head when idle, then take one event of the running generation."""
        if self._current is None:
            seq = self._pop_head() if admit else None
            if seq is None:
                return []
            failed = self._start(seq, self._engine.generate)
            if failed is not None:
                return [failed]
            seq.state = SeqState.DECODE
            self._current = seq
            self._events = iter(seq.generation)
        seq = self._current
        gen = seq.generation
        try:
            return [SeqEvent(seq, token=next(self._events))]
        except StopIteration:
            result = gen.result
        except Exception as exc:  # noqa: B902 - one bad generation must not stop the others
            result = error_result(f'{type(exc).__name__}: {exc}')
        self._current = None
        return [self._done(seq, result)]
