"""The executor: runs a scheduler's Plan on the decoder and the slots' KV caches.

It is the only code that moves KV bytes (admission with prefix reuse, park/unpark of a paused
goal, session checkpoints and committed turns) and the only caller of models: it starts a
goal's Sequence (its session's stored turns read, its images encoded), adds the drafts of
speculating goals to their decode rows (a verify row; drafting may run a draft model), and
makes one decoder call per plan over the plan's rows (OnnxDecoder.run). It decides nothing:
the plan says what to do. Failures are returned in Outputs, per goal for KV moves and per
model call otherwise, so the scheduler ends exactly the goals they concern.

Row policy (decided once, at load, by probe_rows): a graph without a row table (onnxruntime's
GroupQueryAttention and MLAS matmuls) may take another kernel for one row than for several,
and whether one row and N rows give the same bits depends on the CPU's kernels (the AVX-512
and AVX2 builds of MLAS differ here). The probe feeds the same token at the same position in
every row of 1..N-row calls and picks the fewest rows at which a row's logits are
bit-identical whatever the call's row count; such a graph's decode steps are padded to that
many rows, and to slots 0..b-1 (what its batched call runs), so a goal decoded beside others
equals the same goal run alone. A padding row is fed at its slot's own length, past the KV
that slot keeps. A varlen graph runs exactly the plan's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Any, Callable, List, Sequence

import numpy as np

from edge_llm_ros.runtime.decoder import OnnxDecoder
from edge_llm_ros.runtime.kv_cache import KVCache
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.serving.goal import Goal
from edge_llm_ros.serving.scheduler import (Admit, Checkpoint, Commit, DecodeRow, Outputs,
                                            Park, Plan, PrefillRow, Rewind, Start, Unpark)

# Builds a goal's runtime Sequence from its bound request (Engine._start_sequence): binds its
# session's stored turns and encodes its images.
StartSequence = Callable[[Goal, Any], Any]

# Prompt of the row probe: any few tokens; every row gets the same ones.
_PROBE_IDS = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)
_PROBE_TOKEN = 9


@dataclass(frozen=True)
class RowPolicy:
    """How many rows a batched decode call runs (see the module docstring)."""

    min_rows: int        # every decode call runs at least this many rows
    exact: bool          # a goal's logits are the same bits alone and in any batch
    finding: str         # what the probe saw, for diagnostics

    @classmethod
    def single(cls) -> 'RowPolicy':
        return cls(1, True, 'one slot: every decode call has one row')


def probe_rows(decoder: OnnxDecoder) -> RowPolicy:
    """Find the fewest decode rows at which batched and lone rows agree bit for bit.

    Writes a few positions into every slot (call it before any cache holds anything).
    """
    n = decoder.slots
    if n == 1:
        return RowPolicy.single()
    for slot in range(n):
        decoder.run([Row(slot, 0, _PROBE_IDS)])
    pos = len(_PROBE_IDS)
    rows = {}
    for b in range(1, n + 1):
        out = decoder.run([decode_row(slot, _PROBE_TOKEN, pos) for slot in range(b)])
        if any(not np.array_equal(out[0], out[i]) for i in range(1, b)):
            # A row's bits depend on its place in the call: no padding makes them agree.
            return RowPolicy(1, False, f'rows of one {b}-row call differ from each other: '
                                       'batched decode is not bit-exact on this CPU')
        rows[b] = out[0].copy()
    for m in range(1, n + 1):
        if all(np.array_equal(rows[m], rows[b]) for b in range(m + 1, n + 1)):
            if m == 1:
                return RowPolicy(1, True, f'1..{n} rows agree bit for bit')
            diff = float(np.max(np.abs(rows[1] - rows[m])))
            return RowPolicy(m, True, f'1 row differs from {m}+ rows by up to {diff:.2g} '
                                      f'in the logits: decode runs at least {m} rows')
    raise AssertionError('unreachable: m = n always agrees with itself')


class Executor:
    """Runs plans; see the module docstring."""

    def __init__(self, decoder: OnnxDecoder, caches: Sequence[KVCache], rows: RowPolicy,
                 start_sequence: StartSequence, speculation: Any) -> None:
        """:param speculation: runtime.speculative.Speculation, which completes drafts."""
        self._decoder = decoder
        self._caches = list(caches)
        self._start_sequence = start_sequence
        self._speculation = speculation
        self.rows = rows
        # A graph without a row table runs its decode steps over slots 0..b-1 (padded).
        self._pad = not decoder.varlen and decoder.slots > 1

    def run(self, plan: Plan) -> Outputs:
        out = Outputs()
        for op in plan.kv:
            try:
                self._kv(op)
            except Exception as exc:  # noqa: B902 - that goal's failure, reported per goal
                goal = getattr(op, 'goal', None)
                if goal is None:
                    raise
                out.failed[goal.uid] = exc
                if not isinstance(op, Start):
                    # Half-copied KV must never be saved as a session: forget the slot.
                    self._caches[op.slot].reset()
        if plan.rows:
            self._step(plan.rows, out)
        return out

    # --- KV moves --------------------------------------------------------------------------
    def _kv(self, op) -> None:
        caches = self._caches
        if isinstance(op, Start):
            goal = op.goal
            goal.sequence = self._start_sequence(goal, goal.enter_embeddings())
            goal.ran = goal.sequence.request
        elif isinstance(op, Checkpoint):
            caches[op.slot].mark()   # a goal ended here: a reuse point of conv states
            caches[op.slot].checkpoint()
        elif isinstance(op, Rewind):
            caches[op.slot].rewind_to(op.length)
        elif isinstance(op, Commit):
            caches[op.slot].mark()
            caches[op.slot].commit(op.session_id, op.conversation)
        elif isinstance(op, Admit):
            cache = caches[op.slot]
            if op.fresh:
                cache.reset()
            cache.apply(op.reuse, op.goal.request.session_id)
        elif isinstance(op, Park):
            cache = caches[op.slot]
            n = cache.length
            op.goal.park = (cache.keys, [buf[:, :, :n].copy() for buf in cache.buffers],
                            cache.state_copies())
            cache.reset()   # its positions live in the park now; nothing to save as a session
        elif isinstance(op, Unpark):
            keys, data, states = op.goal.park
            caches[op.slot].take(keys, op.goal.request.session_id, data, states)
            op.goal.park = None
        else:
            raise TypeError(f'unknown plan step {op!r}')

    # --- the model call ------------------------------------------------------------------------
    def _step(self, plan_rows: Sequence, out: Outputs) -> None:
        """Run the plan's rows in one decoder call; split the logits back per row."""
        out.started = time.perf_counter()
        out.logits = [None] * len(plan_rows)
        rows: List[Row] = []
        ran: List[int] = []   # plan row index of each decoder row
        try:
            live = [i for i, step in enumerate(plan_rows)
                    if step.goal.uid not in out.failed and not step.goal.done]
            drafts = self._drafts([plan_rows[i] for i in live])
            for i in live:
                step = plan_rows[i]
                goal = step.goal
                if isinstance(step, PrefillRow):
                    n = len(step.ids) + (0 if step.embeds is None else len(step.embeds))
                    rows.append(Row(goal.slot, step.start, step.ids, step.embeds,
                                    logits=1 if step.last else 0,
                                    bidirectional=step.bidirectional,
                                    rope=self._rope(goal, step.start, n),
                                    lora=goal.sequence.request.lora))
                else:
                    draft = tuple(drafts.get(goal.slot, ()))
                    if draft:
                        out.drafts[i] = draft
                        # A conv state cannot be cut back: keep the verify's start.
                        self._caches[goal.slot].keep_undo()
                    ids = np.array(step.replay + (step.token,) + draft, dtype=np.int64)
                    rows.append(Row(goal.slot, step.start, ids, logits=1 + len(draft),
                                    rope=self._rope(goal, step.start, len(ids)),
                                    lora=goal.sequence.request.lora))
                ran.append(i)
            if not rows:
                return
            for i, row, logits in zip(ran, rows, self._run(rows)):
                out.logits[i] = logits
                step = plan_rows[i]
                if isinstance(step, PrefillRow):
                    self._caches[row.slot].append(step.keys)
                    if step.last:
                        self._caches[row.slot].mark()   # a reuse point of conv states
                elif row.length == 1:
                    self._caches[row.slot].append_token(step.token)
                else:
                    self._caches[row.slot].append(row.ids.tolist())
        except Exception as exc:  # noqa: B902 - the call failed for every row in it
            out.error = exc
        finally:
            out.seconds = time.perf_counter() - out.started

    def _rope(self, goal, start: int, length: int):
        """Return a row's M-RoPE positions (None: its KV positions, or a decoder without)."""
        if not getattr(self._decoder, 'mrope', False):
            return None
        return goal.sequence.rope_positions(start, length)

    def _drafts(self, steps: Sequence) -> dict:
        """Draft for every speculating decode row at once: {slot: draft tokens}."""
        asks = {}
        for step in steps:
            if isinstance(step, DecodeRow) and step.room:
                ask = step.goal.sequence.draft_ask(step.room)
                if ask is not None:
                    asks[step.goal.slot] = ask
        return self._speculation.draft(asks) if asks else {}

    def _run(self, rows: List[Row]) -> List[np.ndarray]:
        """Run the rows; return each row's logits ([row.logits, vocab] views)."""
        if not self._pad:
            return _split(self._decoder.run(rows), rows)
        # A batched graph: its decode steps, padded, in one call; each other row in its own
        # (a padding row may share a slot with a prompt row, so they cannot share a call).
        steps = [row for row in rows if row.decode_step]
        got = {}
        if steps:
            logits = self._decoder.run(steps + self._padding(steps))
            got.update(zip(map(id, steps), np.array(logits[:len(steps)])[:, None]))
        others = [row for row in rows if not row.decode_step]
        if others:
            got.update(zip(map(id, others), _split(self._decoder.run(others), others)))
        return [got[id(row)] for row in rows]

    def _padding(self, steps: List[Row]) -> List[Row]:
        """Decode steps on the other slots of 0..b-1 (at least min_rows) of a batched graph.

        A padding row writes past its slot's KV; a slot prefilled in this step is written
        again by its own row afterwards.
        """
        steps = {row.slot for row in steps}
        count = max(max(steps) + 1, self.rows.min_rows)
        padding = []
        for slot in range(count):
            if slot in steps:
                continue
            cache = self._caches[slot]
            if cache.room() == 0:
                cache.rewind_to(cache.length - 1)   # a full idle slot gives up its last one
            padding.append(decode_row(slot, 0, cache.length))
        return padding


def _split(logits: np.ndarray, rows: Sequence[Row]) -> List[np.ndarray]:
    """Cut a call's logits [K, vocab] into each row's [row.logits, vocab] view."""
    out, at = [], 0
    for row in rows:
        out.append(logits[at:at + row.logits])
        at += row.logits
    return out
