"""Rows: what one decoder call runs (docs/architecture.md, "One step").

A row is one slot's next positions: a decode step is a row of one token, a prefill chunk a
row of many, a speculative verify a row of k + 1, an image a row of embeddings. A step runs
all of its rows in one model call (a varlen graph: OnnxDecoder.varlen) and gets logits for
the positions each row asks for, in row order.

`pack` lays the rows out as a varlen graph's inputs: the tokens of every row packed one after
the other (batch 1), the embeddings scattered into their packed positions, a row table the
op library's CausalAttention and ShortConv read (slot, start, length, bidirectional), and the
packed positions that get logits. A graph of an M-RoPE model (qwen2vl) also takes each packed
token's rotary position (t, h, w) (`rope_positions` [3, T]): a row's own `rope` where it
has one (an image's grid, or text after an image, whose rotary position is not its KV
index), else its KV positions on all three.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True, eq=False)
class Row:
    """Positions start.. of `slot`: embeds (if any) first, then ids.

    logits: how many of the row's last positions get logits (1: a decode step or a prompt's
    last chunk, k + 1: a verify pass, 0: a chunk inside a prompt).
    bidirectional: every position of the row also sees the row's later keys (one image's
    rows of a VLM whose image tokens attend both ways).
    """

    slot: int
    start: int
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    embeds: Optional[np.ndarray] = None   # [e, hidden]
    logits: int = 1
    bidirectional: bool = False
    rope: Optional[np.ndarray] = None   # int32 [3, length]: M-RoPE positions (None: start..)
    # LoRA adapters of the row's positions: (id from OnnxDecoder.lora.add, the goal's scale).
    lora: Tuple[Tuple[int, float], ...] = ()

    @property
    def n_embeds(self) -> int:
        return 0 if self.embeds is None else int(self.embeds.shape[0])

    @property
    def length(self) -> int:
        return self.n_embeds + int(self.ids.shape[0])

    @property
    def decode_step(self) -> bool:
        """One token with its logits: what a batched graph runs in its many-row call."""
        return self.embeds is None and self.ids.shape[0] == 1 and self.logits == 1 \
            and not self.bidirectional

    def rope_positions(self) -> np.ndarray:
        """Return the row's M-RoPE positions, int32 [3, length]."""
        if self.rope is not None:
            return self.rope
        return np.broadcast_to(np.arange(self.start, self.start + self.length,
                                         dtype=np.int32), (3, self.length))


def decode_row(slot: int, token: int, position: int) -> Row:
    return Row(slot, position, np.array([token], dtype=np.int64))


def check_rows(rows: Sequence[Row], slots: int, capacity: int) -> None:
    """Raise ValueError for rows no call can run (the engine builds valid ones)."""
    if not rows:
        raise ValueError('a decoder call needs at least one row')
    seen = set()
    for row in rows:
        if not 0 <= row.slot < slots:
            raise ValueError(f'row slot {row.slot} outside the decoder slots 0..{slots - 1}')
        if row.slot in seen:
            raise ValueError(f'two rows of one call name slot {row.slot}: give one row per slot')
        seen.add(row.slot)
        if row.length < 1:
            raise ValueError(f'the row of slot {row.slot} holds no ids and no embeddings')
        if row.start < 0 or row.start + row.length > capacity:
            raise ValueError(f'positions {row.start}..{row.start + row.length - 1} of slot '
                             f'{row.slot} are outside the KV capacity {capacity}')
        if not 0 <= row.logits <= row.length:
            raise ValueError(f'the row of slot {row.slot} asks logits of {row.logits} of its '
                             f'{row.length} positions')


@dataclass(frozen=True, eq=False)
class Packed:
    """A varlen graph's inputs for one call (see the module docstring)."""

    input_ids: np.ndarray     # int64 [1, T] (an embedding's place holds id 0)
    embeds: np.ndarray        # [E, hidden]
    embeds_at: np.ndarray     # int64 [E, 1]: packed positions of the embeddings
    table: np.ndarray         # int32 [R, 4]: slot, start, length, bidirectional
    logits_at: np.ndarray     # int64 [K]: packed positions that get logits, in row order
    rope: Optional[np.ndarray] = None  # int32 [3, T]: M-RoPE graphs only

    def arrays(self) -> tuple:
        """Return the inputs in the graph's order (model_format.VARLEN_INPUTS, then M-RoPE's)."""
        out = (self.input_ids, self.embeds, self.embeds_at, self.table, self.logits_at)
        return out if self.rope is None else out + (self.rope,)


def pack(rows: Sequence[Row], hidden: int, dtype: type, mrope: bool = False) -> Packed:
    """Lay the rows out one after the other (row order kept)."""
    lengths = [row.length for row in rows]
    total = sum(lengths)
    ids = np.zeros((1, total), dtype=np.int64)
    table = np.empty((len(rows), 4), dtype=np.int32)
    embeds, embeds_at, logits_at = [], [], []
    offset = 0
    for r, (row, length) in enumerate(zip(rows, lengths)):
        e = row.n_embeds
        if e:
            embeds.append(row.embeds)
            embeds_at.append(np.arange(offset, offset + e))
        ids[0, offset + e:offset + length] = row.ids
        table[r] = (row.slot, row.start, length, int(row.bidirectional))
        logits_at.append(np.arange(offset + length - row.logits, offset + length))
        offset += length
    return Packed(
        input_ids=ids,
        embeds=(np.ascontiguousarray(np.concatenate(embeds), dtype=dtype) if embeds
                else np.zeros((0, hidden), dtype=dtype)),
        embeds_at=(np.concatenate(embeds_at).astype(np.int64).reshape(-1, 1) if embeds_at
                   else np.zeros((0, 1), dtype=np.int64)),
        table=table,
        logits_at=np.concatenate(logits_at).astype(np.int64),
        rope=(np.ascontiguousarray(np.concatenate([row.rope_positions() for row in rows], 1),
                                   dtype=np.int32) if mrope else None))
