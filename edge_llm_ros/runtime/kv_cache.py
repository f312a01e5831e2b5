"""KV cache bookkeeping: what the preallocated KV buffers hold, and how to reuse it.

The decoder owns nothing but the buffers ([1, kv_heads, max_ctx, head_dim] per layer, bound as
both past and present). This module tracks which positions are valid and what produced them,
so that a new request only prefills what differs from the cache:

* ``keys`` holds one hashable key per cached position: a token id (int), or
  ``('emb', digest, i)`` for position i of prefix embeddings whose bytes hash to ``digest``.
  A position's K/V depends only on the keys before and at it, so equal key prefixes mean
  equal K/V and can be reused: embeddings are keyed by content, never by accident.
* ``find_reuse(keys)`` finds the longest common prefix among the live caches of every slot
  and the saved session snapshots, without walking their keys: each holder keeps a chained
  digest per block of BLOCK positions (``block_hashes``), so equal prefixes are found by a
  binary search over digests plus at most one block of key compares. ``KVCache.apply`` then
  makes that prefix live (restoring it from a snapshot or copying it from another slot);
  ``plan(keys)`` does both for one cache. At least the last prompt position is recomputed to
  get its logits.
* Session snapshots (a SnapshotStore: LRU bounded by count and by bytes) keep alternating
  conversations' prefixes. They are saved lazily, only when another request is about to
  overwrite the live cache, or, when the store persists to SQLite (engine.session_store,
  docs/sessions.md), also by checkpoint() when a sequence ends.

Snapshot storage (``snapshot_dtype``): 'float32' keeps an exact copy of the buffers' dtype
(46 KB per token for SmolLM2-135M). 'int8' stores each (head, position) row of head_dim values
as int8 with one float32 scale (max|x|/127): 3.8x smaller, but a restored prefix differs from a
fresh prefill by up to half a quantization step per value (~0.4 % of the row's max), so logits
after a restore are close to, not bit-equal with, a fresh run; near-ties in greedy decoding can
flip. That holds for float32 live buffers (a decoder of kv_dtype float32). A decoder of kv_dtype
int8 keeps the live cache itself in int8 rows of the same format (``scales``: one float32 per
row, [1, kv_heads, L, 1] per buffer; the attention op writes and reads them): a snapshot is then
a plain copy of its rows and a restore continues bit-equal with the uninterrupted run.

Conv states (a hybrid's conv layers, lfm2: ``states``, one [1, kernel - 1, hidden] view per
conv layer) hold the state after the last live position only, so they cannot be cut back by
position. Such a cache keeps copies of its states at the positions that need them instead
(a few KB each): ``mark()`` at a prompt's end and a turn's end (prefix reuse may stop there:
``find_reuse`` offers only such positions), and ``keep_undo()`` before a speculative verify
(``rewind_to`` that position restores it; the engine feeds the accepted tokens again). They
move with the slot's KV when a goal is parked and resumed. A session snapshot of such a cache
holds the states at its kept ends (its last position and the marks below it), at their own
precision (int8 applies to KV only), so a session continues from the end of its last turn,
or from that turn's prompt end when the next prompt does not extend the whole turn.

Pinned snapshots (warm prompts, serving/warm_prompts.py): a SnapshotStore also keeps
snapshots pinned under a key. find_reuse offers them like any saved prefix, but they belong
to no session: eviction, the store's bounds and clear() never touch them (the engine counts
their bytes in its KV budget at configure instead).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import functools
import hashlib
import logging
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from edge_llm_ros.errors import ContextOverflowError
from edge_llm_ros.runtime.conversation import Conversation

SNAPSHOT_DTYPES = ('float32', 'int8')
# Reuse points of conv states kept per slot (KVCache.mark): the newest ones.
MAX_MARKS = 4
_log = logging.getLogger(__name__)


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common prefix of two key sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# Positions per hashed block of keys (prefix matching granularity; the last partial block is
# compared key by key).
BLOCK = 16


def block_hashes(keys: Sequence[Hashable], start: Sequence[bytes] = ()) -> List[bytes]:
    """Chained digests of the complete BLOCK-sized blocks of keys, continuing `start`.

    Digest i depends on every key of blocks 0..i, so two key lists share their first i blocks
    exactly when (with cryptographic certainty) their digests i-1 are equal.
    """
    out = list(start)
    prev = out[-1] if out else b''
    for i in range(len(out) * BLOCK, len(keys) - BLOCK + 1, BLOCK):
        prev = hashlib.blake2b(prev + repr(tuple(keys[i:i + BLOCK])).encode(),
                               digest_size=16).digest()
        out.append(prev)
    return out


def hashed_common_prefix(a: Sequence[Hashable], a_hashes: Sequence[bytes],
                         b: Sequence[Hashable], b_hashes: Sequence[bytes]) -> int:
    """Length of the common prefix of two key lists, from their block digests.

    A binary search finds the equal leading blocks; only the next block is compared by key.
    """
    lo, hi = 0, min(len(a_hashes), len(b_hashes))
    while lo < hi:
        mid = (lo + hi) // 2
        if a_hashes[mid] == b_hashes[mid]:
            lo = mid + 1
        else:
            hi = mid
    n = lo * BLOCK
    limit = min(len(a), len(b), n + BLOCK)
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def check_fits(prompt_tokens: int, max_tokens: int, capacity: int) -> Optional[str]:
    """Return None when prompt + max_tokens fits in the context, else a message saying why not."""
    if prompt_tokens + max_tokens <= capacity:
        return None
    return (f'prompt {prompt_tokens} tokens + max_tokens {max_tokens} > context {capacity}: '
            'shorten the prompt or lower max_tokens')


@dataclass
class _Snapshot:
    """A copy of the first len(keys) positions of every KV buffer."""

    keys: Tuple[Hashable, ...]
    data: List[np.ndarray]             # per buffer: [1, kv_heads, n, head_dim]
    scales: Optional[List[np.ndarray]]  # int8 only: per buffer [1, kv_heads, n, 1] float32
    # Conv states (a hybrid's cache only): per kept end m <= n, the states after position
    # m - 1, one array per conv layer. The snapshot can be continued from these ends only.
    states: Dict[int, List[np.ndarray]] = field(default_factory=dict)

    @functools.cached_property
    def hashes(self) -> List[bytes]:
        return block_hashes(self.keys)

    @property
    def nbytes(self) -> int:
        extra = sum(s.nbytes for s in self.scales) if self.scales is not None else 0
        kept = sum(a.nbytes for arrays in self.states.values() for a in arrays)
        return sum(d.nbytes for d in self.data) + extra + kept


class SnapshotSink(Protocol):
    """Where a SnapshotStore mirrors its changes (session_store.SessionStore: SQLite).

    save() gets a session's whole entry, its KV prefix (None: none kept) and conversation
    (None: none), so both are written in one row, in one transaction.
    """

    def save(self, session_id: str, snap: Optional[_Snapshot],
             conversation: Optional[Conversation], tick: int) -> None: ...

    def touch(self, session_id: str, tick: int) -> None: ...

    # Pinned snapshots (warm prompts): read back at open, keyed; saved; rows of keys not kept
    # deleted.
    def warm_row(self, key: str) -> Optional[_Snapshot]:
        """Return the snapshot read back for key at open (None: none).

        Raises the sink's own error (a ModelLoadError) when key's row was there but could not
        be used (another model, converter version or layout): the caller prefills it again.
        """

    def save_warm(self, key: str, snap: _Snapshot) -> None: ...

    def keep_warm(self, keys: Sequence[str]) -> None: ...

    def delete(self, session_id: str) -> None: ...

    def clear(self) -> None: ...

    def when_written(self, done: Callable[[], None]) -> None:
        """Call done() (from any thread) once everything recorded so far is on disk."""

    def close(self) -> None: ...


@dataclass
class _Session:
    """What the store keeps of one session: a KV prefix, a conversation, or both."""

    snap: Optional[_Snapshot] = None
    conversation: Optional[Conversation] = None

    @property
    def nbytes(self) -> int:
        """Return the KV prefix's bytes plus the conversation's image rows (text: a few KB)."""
        return (self.snap.nbytes if self.snap is not None else 0) + self.media_nbytes

    @property
    def media_nbytes(self) -> int:
        return self.conversation.media_nbytes if self.conversation is not None else 0


class SnapshotStore:
    """Saved sessions (KV prefixes and conversations), least recently used first.

    One store serves every slot's cache, so a session can continue in whichever slot is free.
    Bounded by count (max_sessions) and by bytes (max_bytes, None = no byte bound) of the KV
    prefixes and the conversations' image rows: the least recently used sessions are evicted
    until both hold; a prefix that does not fit beside its own conversation's rows is not kept
    (logged), but the conversation is, and the session just saved is never evicted for its
    own rows (it may then be all the store holds). A sink (SQLite
    persistence) mirrors every change: what is evicted here is deleted there, so the disk
    holds what memory holds.
    """

    def __init__(self, max_sessions: int = 8, max_bytes: Optional[int] = None,
                 sink: Optional[SnapshotSink] = None) -> None:
        if max_sessions < 0:
            raise ValueError(f'max_sessions must be >= 0, got {max_sessions}')
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f'max_bytes must be >= 0 or None, got {max_bytes}')
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._sink = sink
        self._entries: 'OrderedDict[str, _Session]' = OrderedDict()
        self._bytes = 0
        self._tick = 0  # LRU clock, persisted so a restart keeps the order
        # Warm prompts: pinned, outside the LRU and its bounds, in the order they were added.
        self._pinned: 'OrderedDict[str, _Snapshot]' = OrderedDict()

    @property
    def persistent(self) -> bool:
        """Whether a sink (SQLite) keeps the sessions across restarts."""
        return self._sink is not None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> List[str]:
        """Session ids, least recently used first."""
        return list(self._entries)

    def prefix_ids(self) -> List[str]:
        """Session ids that have a KV prefix saved, least recently used first."""
        return [sid for sid, e in self._entries.items() if e.snap is not None]

    def values(self) -> List[_Snapshot]:
        """Return the KV prefixes kept: the pinned ones, then the sessions' (if they have one)."""
        return [*self._pinned.values(),
                *(e.snap for e in self._entries.values() if e.snap is not None)]

    @property
    def sink(self) -> Optional[SnapshotSink]:
        """Return where the store mirrors its changes (None: memory only)."""
        return self._sink

    def pin(self, key: str, snap: _Snapshot, save: bool = True) -> None:
        """Keep snap under key for good: never evicted, outside max_sessions and max_bytes.

        save: write it to the sink too (False: it was read back from there).
        """
        self._pinned[key] = snap
        if save and self._sink is not None:
            self._sink.save_warm(key, snap)

    def stored_pin(self, key: str) -> Optional[_Snapshot]:
        """Return the snapshot the sink read back for key at open (None: none, or no sink).

        Raises what the sink's warm_row raises for a stored row this model cannot use.
        """
        return self._sink.warm_row(key) if self._sink is not None else None

    def keep_pinned_rows(self) -> None:
        """Delete the sink's rows of snapshots that are not pinned now."""
        if self._sink is not None:
            self._sink.keep_warm(list(self._pinned))

    def pinned(self, key: str) -> Optional[_Snapshot]:
        """Return the snapshot pinned under key (None: none)."""
        return self._pinned.get(key)

    def pinned_nbytes(self) -> int:
        """Return the bytes of every pinned snapshot."""
        return sum(snap.nbytes for snap in self._pinned.values())

    def get(self, session_id: str) -> Optional[_Snapshot]:
        entry = self._entries.get(session_id)
        return entry.snap if entry is not None else None

    def conversation(self, session_id: str) -> Optional[Conversation]:
        entry = self._entries.get(session_id)
        return entry.conversation if entry is not None else None

    def fits(self, nbytes: int) -> bool:
        """Whether one snapshot of this size can be kept at all."""
        return self.max_sessions > 0 and (self.max_bytes is None or nbytes <= self.max_bytes)

    def put(self, session_id: str, snap: _Snapshot) -> bool:
        """Keep snap as the session's prefix (most recently used); evict beyond the bounds.

        Returns False when snap alone exceeds max_bytes (or max_sessions is 0): then it is not
        kept, and an older, shorter prefix of the same session stays if there was one.
        """
        entry = self._entries.get(session_id) or _Session()
        if not self.fits(snap.nbytes + entry.media_nbytes):
            self.refuse(session_id, len(snap.keys), snap.nbytes, entry.media_nbytes)
            return False
        self._store(session_id, _Session(snap, entry.conversation))
        return True

    def commit(self, session_id: str, conversation: Conversation,
               snap: Optional[_Snapshot] = None) -> None:
        """Keep a session's conversation after a turn, with its KV prefix when given.

        One entry, one sink write: the turn and its KV are on disk together or not at all.
        A prefix that does not fit in max_bytes beside the conversation's image rows is not
        kept; the conversation is.
        """
        if self.max_sessions == 0:
            return
        entry = self._entries.get(session_id) or _Session()
        rows = conversation.media_nbytes
        if snap is not None and not self.fits(snap.nbytes + rows):
            self.refuse(session_id, len(snap.keys), snap.nbytes, rows)
            snap = None
        keep = snap if snap is not None else entry.snap
        if keep is not None and snap is None and not self.fits(keep.nbytes + rows):
            # The prefix kept from an earlier turn no longer fits beside this turn's images.
            self.refuse(session_id, len(keep.keys), keep.nbytes, rows)
            keep = None
        self._store(session_id, _Session(keep, conversation))

    def _store(self, session_id: str, entry: _Session) -> None:
        self._tick += 1
        self._insert(session_id, entry)
        if self._sink is not None:
            self._sink.save(session_id, entry.snap, entry.conversation, self._tick)
        self._evict()

    def refuse(self, session_id: str, positions: int, nbytes: int, image_bytes: int = 0) -> None:
        """Log that a prefix too big for max_bytes (beside its image rows) is not kept."""
        if self.max_sessions > 0:
            rows = f' beside {image_bytes} bytes of image rows' if image_bytes else ''
            _log.info('session %r: prefix of %d positions is %d bytes%s > sessions.max_bytes '
                      '%d: not kept (raise sessions.max_bytes or use kv.dtype int8)',
                      session_id, positions, nbytes, rows, self.max_bytes)

    def load(self, session_id: str, snap: Optional[_Snapshot],
             conversation: Optional[Conversation], tick: int) -> bool:
        """Put a session read back from the sink (oldest first), without writing it back."""
        rows = conversation.media_nbytes if conversation is not None else 0
        if snap is not None and not self.fits(snap.nbytes + rows):
            snap = None
        if snap is None and conversation is None or self.max_sessions == 0:
            return False
        self._tick = max(self._tick, tick)
        self._insert(session_id, _Session(snap, conversation))
        self._evict()
        return session_id in self._entries

    def _insert(self, session_id: str, entry: _Session) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[session_id] = entry
        self._bytes += entry.nbytes

    def _evict(self) -> None:
        # The newest entry stays whatever its rows weigh: dropping a conversation just saved
        # would lose it (only the count bound, with max_sessions 0, keeps nothing).
        while self._entries and (len(self._entries) > self.max_sessions or (
                self.max_bytes is not None and self._bytes > self.max_bytes
                and len(self._entries) > 1)):
            session_id, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            if self._sink is not None:
                self._sink.delete(session_id)

    def touch(self, session_id: str) -> None:
        if session_id in self._entries:
            self._entries.move_to_end(session_id)
            self._tick += 1
            if self._sink is not None:
                self._sink.touch(session_id, self._tick)

    def pop(self, session_id: str) -> bool:
        old = self._entries.pop(session_id, None)
        if old is None:
            return False
        self._bytes -= old.nbytes
        if self._sink is not None:
            self._sink.delete(session_id)
        return True

    def clear(self) -> None:
        """Forget every session, in memory and in the sink."""
        self._entries.clear()
        self._bytes = 0
        if self._sink is not None:
            self._sink.clear()

    def when_saved(self, done: Callable[[], None]) -> None:
        """Call done() once what was committed so far persists (at once without a sink)."""
        if self._sink is None:
            done()
        else:
            self._sink.when_written(done)

    def close(self) -> None:
        """Flush and close the sink, keeping what it saved; forget the in-memory copies."""
        self._entries.clear()
        self._pinned.clear()
        self._bytes = 0
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.close()

    def nbytes(self) -> int:
        return self._bytes


@dataclass(frozen=True)
class Reuse:
    """Where a request's reusable prefix is: `length` positions from `source`.

    source None: the target cache's own live keys; a KVCache: another slot's live keys (copied
    over); a _Snapshot: a saved session prefix (restored).
    """

    length: int
    source: Union[None, 'KVCache', _Snapshot] = None


class KVCache:
    """Bookkeeping of one slot's preallocated KV buffers (see the module docstring)."""

    def __init__(self, buffers: Sequence[np.ndarray], capacity: int,
                 snapshot_dtype: str = 'float32', max_sessions: int = 8,
                 store: Optional[SnapshotStore] = None,
                 max_bytes: Optional[int] = None,
                 states: Sequence[np.ndarray] = (),
                 scales: Sequence[np.ndarray] = ()) -> None:
        if snapshot_dtype not in SNAPSHOT_DTYPES:
            raise ValueError(f'kv_dtype must be one of {SNAPSHOT_DTYPES}, got {snapshot_dtype!r}')
        if scales and (snapshot_dtype != 'int8' or len(scales) != len(buffers) or
                       any(b.dtype != np.int8 for b in buffers)):
            raise ValueError('int8 live buffers need one scale buffer each and kv_dtype int8')
        for buf in buffers:
            if buf.ndim != 4 or buf.shape[2] < capacity:
                raise ValueError(
                    f'KV buffer of shape {buf.shape} cannot hold {capacity} positions')
        self._buffers = list(buffers)
        self._scales = list(scales)   # int8 live KV: each buffer's row scales
        self._states = list(states)   # conv states: the state after the last live position
        self._capacity = capacity
        self._snapshot_dtype = snapshot_dtype
        # A given store carries its own bounds (max_sessions/max_bytes here are then unused).
        self._sessions = store if store is not None else SnapshotStore(max_sessions, max_bytes)
        self._keys: List[Hashable] = []
        self._hashes: List[bytes] = []   # block_hashes(self._keys), kept up to date
        self._owner = ''          # session whose conversation the live cache holds
        self._owner_saved = True  # its snapshot already equals the live cache
        # Conv states kept at positions (see the module docstring): reuse points, newest last,
        # and the position a verify pass started at.
        self._marks: 'OrderedDict[int, List[np.ndarray]]' = OrderedDict()
        self._undo: Optional[Tuple[int, List[np.ndarray]]] = None

    # --- state -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def length(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> Tuple[Hashable, ...]:
        """Return a copy of the live position keys, for inspection: matching never copies."""
        return tuple(self._keys)

    @property
    def buffers(self) -> List[np.ndarray]:
        """Return every array holding positions (axis 2): the KV buffers, then their scales."""
        return self._buffers + self._scales

    @property
    def states(self) -> List[np.ndarray]:
        """Return the conv-state views (empty: every layer keeps KV per position)."""
        return self._states

    def state_copies(self) -> List[np.ndarray]:
        """Copy the conv states (what a paused goal parks beside its positions)."""
        return [s.copy() for s in self._states]

    @property
    def rewindable(self) -> bool:
        """Whether any earlier position can be made the end again (KV only)."""
        return not self._states

    def mark(self) -> None:
        """Keep the conv states of the current end as a reuse point (no-op for KV only)."""
        if not self._states:
            return
        n = len(self._keys)
        self._marks.pop(n, None)
        self._marks[n] = self.state_copies()
        while len(self._marks) > MAX_MARKS:
            self._marks.popitem(last=False)

    def keep_undo(self) -> None:
        """Keep the conv states of the current end until the next rewind (a verify pass)."""
        if self._states:
            self._undo = (len(self._keys), self.state_copies())

    def _states_at(self, n: int) -> Optional[List[np.ndarray]]:
        """Return the conv states after position n - 1, if kept (the live end's: current)."""
        if n == len(self._keys):
            return self._states
        if self._undo is not None and self._undo[0] == n:
            return self._undo[1]
        return self._marks.get(n)

    def _ends(self) -> List[int]:
        """Positions this cache can be cut back to with its conv states (0 always)."""
        return [0, len(self._keys), *self._marks] + \
            ([self._undo[0]] if self._undo is not None else [])

    @property
    def store(self) -> SnapshotStore:
        return self._sessions

    def room(self) -> int:
        return self._capacity - len(self._keys)

    def live_bytes(self) -> int:
        """Bytes the live positions take in the buffers (at their own precision)."""
        per = sum(b.shape[0] * b.shape[1] * b.shape[3] * b.itemsize for b in self.buffers)
        return per * len(self._keys)

    def sessions(self) -> List[str]:
        """Return the ids of the sessions whose KV prefix is saved, least recently used first."""
        return self._sessions.prefix_ids()

    @property
    def owner(self) -> str:
        """Return the session whose conversation the live cache holds ('' = none named)."""
        return self._owner

    # --- live cache --------------------------------------------------------------------------
    def append(self, keys: Sequence[Hashable]) -> None:
        """Record that the decoder just wrote K/V for these positions (after the current ones)."""
        if len(self._keys) + len(keys) > self._capacity:
            raise ContextOverflowError(
                f'KV cache full: {len(self._keys)} + {len(keys)} positions > capacity '
                f'{self._capacity}: raise max_context or shorten the request')
        self._keys.extend(keys)
        self._hashes = block_hashes(self._keys, self._hashes)
        self._owner_saved = False

    def append_token(self, token_id: int) -> None:
        """Cheap single-position append for the decode loop (the caller checked the room)."""
        self._keys.append(token_id)
        if len(self._keys) % BLOCK == 0:
            self._hashes = block_hashes(self._keys, self._hashes)
        self._owner_saved = False

    def rewind_to(self, n: int) -> None:
        """Forget every position from n on (the buffers' bytes there become garbage).

        With conv states, n must be 0 or a kept position (mark, undo), whose states come back.
        """
        if not 0 <= n <= len(self._keys):
            raise ValueError(f'cannot rewind to {n}: the cache holds {len(self._keys)} positions')
        if n < len(self._keys) and self._states:
            states = self._states_at(n)
            if states is None and n > 0:
                raise ValueError(f'cannot rewind to {n}: no conv state was kept there')
            for dst, src in zip(self._states, states or ()):
                dst[...] = src
            self._undo = None
        self._forget_from(n)

    def _forget_from(self, n: int) -> None:
        if n < len(self._keys):
            del self._keys[n:]
            del self._hashes[n // BLOCK:]
            self._owner_saved = False
        for m in [m for m in self._marks if m > n]:
            del self._marks[m]

    def reset(self) -> None:
        """Empty the live cache (saved sessions stay)."""
        self._keys.clear()
        self._hashes.clear()
        self._owner = ''
        self._owner_saved = True
        self._marks.clear()
        self._undo = None

    def clear_sessions(self) -> None:
        """Forget every saved session (in the SQLite store too, when there is one)."""
        self._sessions.clear()

    def checkpoint(self) -> bool:
        """Save the live cache as its owner's snapshot now, when sessions persist.

        Called when a sequence ends, so that a restart (or a kill) finds its last turn; without
        a persistent store snapshots stay lazy (saved only before another session overwrites
        the live cache) and this is a no-op. Returns whether a snapshot was taken.
        """
        if not self._sessions.persistent or not self._owner or self._owner_saved:
            return False
        self._save(self._owner)
        return True

    def commit(self, session_id: str, conversation: Conversation) -> None:
        """Keep a session's conversation after a turn that ended in this slot.

        With a persistent store the live KV is saved with it (one row, one transaction);
        without one the KV stays live and is saved lazily, as any session prefix.
        """
        snap = None
        if self._sessions.persistent and self._owner == session_id and self._keys:
            snap = self._snapshot()
            if snap is not None:
                self._owner_saved = True
        self._sessions.commit(session_id, conversation, snap)

    def close(self) -> None:
        """Checkpoint, empty the live cache and close the store (its saved sessions stay).

        With several caches on one store: checkpoint() and reset() each, then close the store.
        """
        self.checkpoint()
        self.reset()
        self._sessions.close()

    def drop_session(self, session_id: str) -> bool:
        """Forget one session: its snapshot, and the live cache if that session owns it.

        Returns whether anything of it was kept (a snapshot or the live cache).
        """
        found = self._sessions.pop(session_id)
        if session_id and self._owner == session_id:
            found = found or bool(self._keys)
            self.reset()
        return found

    def known_sessions(self) -> List[str]:
        """Return the sessions with a kept prefix: saved snapshots and the live cache's owner."""
        names = self._sessions.ids()
        if self._owner and self._keys and self._owner not in self._sessions:
            names.append(self._owner)
        return names

    # --- reuse -------------------------------------------------------------------------------
    def common_length(self, keys: Sequence[Hashable], hashes: Sequence[bytes]) -> int:
        """Positions of the live cache that equal keys' first ones (hashes: block_hashes(keys))."""
        return hashed_common_prefix(self._keys, self._hashes, keys, hashes)

    def find_reuse(self, keys: Sequence[Hashable], hashes: Sequence[bytes], limit: int,
                   others: Sequence['KVCache'] = (), own: bool = True) -> Reuse:
        """Return the longest prefix of keys (at most `limit`) this cache can make live.

        Candidates: its own live keys (unless `own` is False), the live keys of `others`
        (other slots, copied over) and every saved snapshot; ties go to the one that copies
        least (own, then snapshot, then another slot).
        """
        if self._states:   # conv states exist at kept positions only
            return self._find_kept(keys, hashes, limit, others, own)
        best = Reuse(min(self.common_length(keys, hashes), limit) if own else 0)
        for snap in self._sessions.values():
            n = min(hashed_common_prefix(snap.keys, snap.hashes, keys, hashes), limit)
            if n > best.length:
                best = Reuse(n, snap)
        for other in others:
            if other is not self:
                n = min(other.common_length(keys, hashes), limit)
                if n > best.length:
                    best = Reuse(n, other)
        return best

    def _find_kept(self, keys: Sequence[Hashable], hashes: Sequence[bytes], limit: int,
                   others: Sequence['KVCache'], own: bool) -> Reuse:
        """find_reuse with conv states: the longest common prefix that ends at a kept end."""
        best = Reuse(0)
        if own:
            common = min(self.common_length(keys, hashes), limit)
            best = Reuse(max((m for m in self._ends() if m <= common), default=0))
        for snap in self._sessions.values():
            common = min(hashed_common_prefix(snap.keys, snap.hashes, keys, hashes), limit)
            n = max((m for m in snap.states if m <= common), default=0)
            if n > best.length:
                best = Reuse(n, snap)
        for other in others:
            if other is not self:
                common = min(other.common_length(keys, hashes), limit)
                n = max((m for m in other._ends() if m <= common), default=0)
                if n > best.length:
                    best = Reuse(n, other)
        return best

    def apply(self, reuse: Reuse, session_id: str = '') -> int:
        """Make reuse.length positions live for `session_id`; return that length.

        When another session's unsaved conversation is about to be overwritten, it is saved as
        that session's snapshot first.
        """
        source, n = reuse.source, reuse.length
        if source is None:
            keep = n
        elif isinstance(source, KVCache):
            keep = hashed_common_prefix(self._keys, self._hashes, source._keys, source._hashes)
        else:
            keep = hashed_common_prefix(self._keys, self._hashes, source.keys, source.hashes)
        keep = min(keep, n)
        if self._owner and self._owner != session_id and not self._owner_saved \
                and keep < len(self._keys):
            self._save(self._owner)
        if source is not None and self._states:
            # Conv states come whole from the source's kept end n; the KV positions below
            # keep are this cache's own and stay.
            kept = source._states_at(n) if isinstance(source, KVCache) else source.states[n]
            self._forget_from(min(keep, len(self._keys)))
            self._undo = None
            for dst, src in zip(self._states, kept):
                dst[...] = src
        else:
            self.rewind_to(min(keep, len(self._keys)))
        if isinstance(source, KVCache):
            self.copy_positions(source.buffers, source._keys, n)
        elif source is not None:
            self._restore(source, n)
            # The snapshot's earlier kept ends stay reuse points (a later save keeps them).
            for m in sorted(source.states):
                if keep < m < n:
                    self._marks[m] = [a.copy() for a in source.states[m]]
        self._sessions.touch(session_id)
        self._owner = session_id
        self._owner_saved = False
        return n

    def plan(self, keys: Sequence[Hashable], session_id: str = '', recompute: int = 1,
             hashes: Optional[Sequence[bytes]] = None) -> int:
        """Prepare the live cache for a request of these position keys (this cache alone).

        Returns how many leading positions are already in place (0 .. len(keys) - recompute);
        the caller prefills keys[returned:] (at least `recompute` >= 1 positions, since the
        last one must be computed for its logits).
        """
        if not keys:
            raise ValueError('a request needs at least one position')
        if recompute < 1:
            raise ValueError(f'recompute must be >= 1, got {recompute}')
        if hashes is None:
            hashes = block_hashes(keys)
        limit = max(len(keys) - recompute, 0)
        return self.apply(self.find_reuse(keys, hashes, limit), session_id)

    def take(self, keys: Sequence[Hashable], session_id: str,
             data: Sequence[np.ndarray], states: Sequence[np.ndarray] = ()) -> None:
        """Hold exactly `keys`, whose K/V are `data` (a parked or another slot's copy).

        `states`: the conv states after those keys (required when the cache has conv layers).
        The live cache's unsaved conversation of another session is saved first.
        """
        if len(states) != len(self._states):
            raise ValueError(f'{len(states)} conv states for a cache of {len(self._states)}')
        self.apply(Reuse(0), session_id)
        self.rewind_to(0)
        self.copy_positions(data, keys, len(keys))
        for dst, src in zip(self._states, states):
            dst[...] = src

    def copy_positions(self, data: Sequence[np.ndarray], keys: Sequence[Hashable],
                       n: int) -> None:
        """Copy positions length..n-1 of `data` (per buffer [1, heads, >=n, dim]) in, with keys."""
        start = len(self._keys)
        if n > self._capacity:
            raise ContextOverflowError(f'{n} positions > capacity {self._capacity}')
        if len(data) != len(self.buffers):
            raise ValueError(f'{len(data)} arrays for a cache of {len(self.buffers)}')
        for buf, src in zip(self.buffers, data):
            buf[:, :, start:n] = src[:, :, start:n]
        self._keys.extend(keys[start:n])
        self._hashes = block_hashes(self._keys, self._hashes)
        self._owner_saved = False

    def snapshot_prefix(self, n: int) -> _Snapshot:
        """Copy the first n live positions (a warm prompt's), whatever the store's bounds.

        With conv states, n must be the live end or a kept position (ValueError otherwise).
        """
        if not 0 < n <= len(self._keys):
            raise ValueError(f'cannot copy {n} positions: the cache holds {len(self._keys)}')
        states = self._states_at(n) if self._states else None
        if self._states and states is None:
            raise ValueError(f'cannot copy {n} positions: no conv state was kept there')
        snap = self._copy(n)
        if states is not None:
            snap.states = {n: [a.copy() for a in states]}
        return snap

    def _save(self, session_id: str) -> None:
        snap = self._snapshot()
        if snap is not None:
            self._sessions.put(session_id, snap)
        if session_id == self._owner:
            self._owner_saved = True

    def _snapshot(self) -> Optional[_Snapshot]:
        """Copy the live positions (None when the store could not keep them: nothing copied)."""
        if self._sessions.max_sessions == 0 or not self._keys:
            return None
        n = len(self._keys)
        nbytes = self._snapshot_nbytes(n)
        if not self._sessions.fits(nbytes):  # do not copy what cannot be kept
            self._sessions.refuse(self._owner, n, nbytes)
            return None
        snap = self._copy(n)
        if self._states:
            snap.states = {m: [a.copy() for a in st] for m, st in self._marks.items()}
            snap.states[n] = self.state_copies()
        snap.__dict__['hashes'] = list(self._hashes)   # already known: no rehash
        return snap

    def _copy(self, n: int) -> _Snapshot:
        """Copy the first n positions' KV at the snapshot precision (no conv states yet)."""
        if self._scales:   # int8 live rows: the snapshot's format already
            return _Snapshot(tuple(self._keys[:n]), [b[:, :, :n].copy() for b in self._buffers],
                             [s[:, :, :n].copy() for s in self._scales])
        if self._snapshot_dtype == 'int8':
            pairs = [quantize_int8(buf[:, :, :n]) for buf in self._buffers]
            return _Snapshot(tuple(self._keys[:n]), [q for q, _ in pairs], [s for _, s in pairs])
        return _Snapshot(tuple(self._keys[:n]), [buf[:, :, :n].copy() for buf in self._buffers],
                         None)

    def _snapshot_nbytes(self, n: int) -> int:
        """Bytes of a snapshot of n positions (known before copying anything)."""
        ends = len(self._marks.keys() | {n}) if self._states else 0
        total = ends * sum(s.nbytes for s in self._states)
        for buf in self._buffers:
            rows = buf.shape[0] * buf.shape[1] * n
            if self._snapshot_dtype == 'int8':
                total += rows * buf.shape[3] + rows * 4
            else:
                total += rows * buf.shape[3] * buf.itemsize
        return total

    def _restore(self, snap: _Snapshot, n: int) -> None:
        # The live cache was rewound to what it shares with the snapshot: copy only the rest.
        if self._scales:   # int8 rows into int8 rows: a plain copy
            if snap.scales is None:
                raise ValueError('a float32 snapshot cannot be restored into int8 live KV')
            self.copy_positions(list(snap.data) + list(snap.scales), snap.keys, n)
            return
        if snap.scales is None:
            self.copy_positions(snap.data, snap.keys, n)
            return
        start = len(self._keys)
        for i, buf in enumerate(self._buffers):
            buf[:, :, start:n] = dequantize_int8(
                snap.data[i][:, :, start:n], snap.scales[i][:, :, start:n], buf.dtype)
        self._keys.extend(snap.keys[start:n])
        self._hashes = block_hashes(self._keys, self._hashes)
        self._owner_saved = False


def quantize_int8(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per row of the last axis: returns (q, scale)."""
    xf = x.astype(np.float32, copy=False)
    scale = np.abs(xf).max(axis=-1, keepdims=True) / 127.0
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(xf / safe), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_int8(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Inverse of quantize_int8 (up to half a step per value)."""
    return (q.astype(np.float32) * scale).astype(dtype, copy=False)
