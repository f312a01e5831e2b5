"""The executor: runs a scheduler's Plan on the decoder and the slots' KV caches.

It is the only code that moves KV bytes (admission with prefix reuse, park/unpark of a paused
goal, moving a goal down a slot, session checkpoints and committed turns) and the only caller
of the decoder (one prefill chunk, or one batched decode step). It decides nothing: the plan
says what to do.
Failures are returned in Outputs, per goal for KV moves and per model call otherwise, so the
scheduler ends exactly the goals they concern.

Row policy (decided once, at load, by probe_rows): onnxruntime's quantized matmuls may take
another kernel for one row than for several, and whether one row and N rows give the same
bits depends on the CPU's kernels (the AVX-512 and AVX2 builds of MLAS differ here). The probe
feeds the same token at the same position in every row of 1..N-row calls and picks the
fewest rows at which a row's logits are bit-identical whatever the call's row count; decode
calls are padded to that many rows, so a goal decoded beside others equals the same goal run
alone. A padding row is fed at its slot's own length, past the KV that slot keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
import time
from typing import List, Sequence

import numpy as np

from edge_llm_ros.runtime.decoder import OnnxDecoder
from edge_llm_ros.runtime.kv_cache import KVCache
from edge_llm_ros.serving.scheduler import (Admit, Checkpoint, Commit, Decode, Move, Outputs,
                                            Park, Plan, Prefill, Rewind, Unpark)

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
        decoder.forward(_PROBE_IDS, None, 0, slot=slot)
    pos = len(_PROBE_IDS)
    rows = {}
    for b in range(1, n + 1):
        out = decoder.decode_rows([_PROBE_TOKEN] * b, [pos] * b)
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

    def __init__(self, decoder: OnnxDecoder, caches: Sequence[KVCache],
                 rows: RowPolicy) -> None:
        self._decoder = decoder
        self._caches = list(caches)
        self.rows = rows
        self._single = decoder.slots == 1

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
                # Half-copied KV must never be saved as a session: forget the target slot.
                self._caches[getattr(op, 'dst', getattr(op, 'slot', 0))].reset()
        if plan.prefill is not None and plan.prefill.goal.uid not in out.failed:
            self._prefill(plan.prefill, out)
        if plan.decode is not None:
            self._decode(plan.decode, out)
        return out

    # --- KV moves --------------------------------------------------------------------------
    def _kv(self, op) -> None:
        caches = self._caches
        if isinstance(op, Checkpoint):
            caches[op.slot].checkpoint()
        elif isinstance(op, Rewind):
            caches[op.slot].rewind_to(op.length)
        elif isinstance(op, Commit):
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
        elif isinstance(op, Move):
            src = caches[op.src]
            caches[op.dst].take(src.keys, src.owner, src.buffers, src.states)
            src.reset()
        else:
            raise TypeError(f'unknown plan step {op!r}')

    # --- model calls ---------------------------------------------------------------------------
    def _prefill(self, step: Prefill, out: Outputs) -> None:
        t = time.perf_counter()
        try:
            out.prefill_logits = self._decoder.forward(step.ids, step.embeds, step.start,
                                                       step.slot, step.bidirectional)
            self._caches[step.slot].append(step.keys)
        except Exception as exc:  # noqa: B902 - ends that goal (Scheduler.update)
            out.prefill_error = exc
        out.prefill_s = time.perf_counter() - t

    def _decode(self, step: Decode, out: Outputs) -> None:
        out.decode_started = time.perf_counter()
        try:
            if step.draft:   # a verify pass of row 0's goal (slot 0)
                fed = (step.tokens[0],) + step.draft
                out.decode_logits = self._decoder.verify(fed, step.positions[0], 0)
                self._caches[0].append(fed)
                return
            if self._single:
                out.decode_logits = self._decoder.decode(step.tokens[0],
                                                         step.positions[0])[None, :]
            else:
                tokens, positions, padding = self._row_inputs(step)
                out.decode_logits = self._decoder.decode_rows(tokens, positions, padding)
            caches = self._caches
            for row, goal in enumerate(step.goals):
                if goal is not None and goal.uid not in out.failed:
                    caches[row].append_token(step.tokens[row])
        except Exception as exc:  # noqa: B902 - the call failed for every row in it
            out.decode_error = exc

    def _row_inputs(self, step: Decode) -> tuple:
        """Tokens, positions and padding rows of the call.

        A padding row writes past its slot's KV, and its conv states (a hybrid) are kept
        (OnnxDecoder.decode_rows): the slot may hold a sequence between prefill chunks.
        """
        count = max(len(step.goals), self.rows.min_rows)
        tokens: List[int] = list(step.tokens) + [0] * (count - len(step.goals))
        positions: List[int] = list(step.positions) + [0] * (count - len(step.goals))
        padding: List[int] = []
        for row in range(count):
            if row < len(step.goals) and step.goals[row] is not None:
                continue
            cache = self._caches[row]
            if cache.room() == 0:
                cache.rewind_to(cache.length - 1)   # a full idle slot gives up its last one
            positions[row] = cache.length
            padding.append(row)
        return tokens, positions, padding
