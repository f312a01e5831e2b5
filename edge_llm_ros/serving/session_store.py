"""Saved session prefixes that survive a restart: a SQLite (WAL) mirror of the SnapshotStore.

    store = open_sessions(config, model_dir, buffers, capacity, states)  # at Engine init
    cache = KVCache(buffers, capacity, config.kv_dtype, store=store)

* What is saved: per session, one row: its conversation (turns and ids, JSON; '' for a KV
  prefix without one) and its images' embedding rows (media), its position keys (token ids,
  and ('emb' or 'img', digest, i) for embedding rows, as JSON) and its KV prefix exactly as
  the snapshot holds it (int8 rows with float32 scales when kv.dtype is int8, else the KV
  buffers' dtype; empty when no KV is kept), followed by a hybrid's conv states at the
  snapshot's kept ends (listed in state_ends). A turn and its KV are written in one
  transaction: after a kill -9 the session holds its last committed turn with that turn's
  KV, or the turn before, never half.
* Writes never run on the decode path: SnapshotStore calls save/touch/delete/clear here, which
  only record the latest operation per session under a lock; a writer thread commits all
  pending operations in one transaction (repeated saves of one session coalesce). close()
  flushes. A kill -9 loses at most the transaction being written: SQLite's WAL journal keeps
  the file valid.
* The disk holds what memory holds: the SnapshotStore's byte/count bounds evict here too.
* A restart restores the rows written for this model (model_hash), by this converter version
  and for this KV layout. Another row keeps its conversation as text (a model update: the
  next turn prefills it again) or, without one, is deleted; one log line says how many and
  why. See docs/sessions.md.
* Warm prompts (serving/warm_prompts.py) have their own table, keyed by a digest of their
  token ids: read at open (warm_rows), each restored at configure without a prefill when it
  was written for this model, converter version and KV layout; another one is dropped with
  one log line and a StoredWarmStateError that warm_row() raises: the engine prefills and
  saves it again, and reports the error as the warm prompt's status. Eviction and clear() never
  touch them; the engine deletes the rows of prompts no longer configured.
"""
from __future__ import annotations

from dataclasses import dataclass
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import sqlite3
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import CONVERTER_VERSION
from edge_llm_ros.runtime.conversation import Conversation
from edge_llm_ros.runtime.kv_cache import _Snapshot, SnapshotStore
from edge_llm_ros.serving.warm_prompts import StoredWarmStateError

_log = logging.getLogger(__name__)
APPLICATION_ID = 0x454C5353  # 'ELSS': PRAGMA application_id of an edge_llm_ros session store
# PRAGMA user_version; 2: the conversation; 3: its images' rows; 4: a hybrid's conv states;
# 5: the warm prompts' table.
SCHEMA_VERSION = 5
_SCHEMA = ('CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, '
           'model_hash TEXT NOT NULL, converter_version TEXT NOT NULL, layout TEXT NOT NULL, '
           'keys TEXT NOT NULL, positions INTEGER NOT NULL, nbytes INTEGER NOT NULL, '
           "tick INTEGER NOT NULL, data BLOB NOT NULL, conversation TEXT NOT NULL DEFAULT '', "
           "media BLOB NOT NULL DEFAULT x'', state_ends TEXT NOT NULL DEFAULT '[]')")
_WARM_SCHEMA = ('CREATE TABLE IF NOT EXISTS warm_prompts (key TEXT PRIMARY KEY, '
                'model_hash TEXT NOT NULL, converter_version TEXT NOT NULL, '
                'layout TEXT NOT NULL, keys TEXT NOT NULL, data BLOB NOT NULL, '
                "state_ends TEXT NOT NULL DEFAULT '[]')")
_COLUMNS = ('session_id, model_hash, converter_version, layout, keys, positions, nbytes, tick, '
            'data, conversation, media, state_ends')
# Older files are upgraded in place at open. Version 1 rows (KV prefixes only) keep their KV
# and have no conversation; version 2 conversations have no images; rows before version 4
# have no conv states (their models had none).
_MIGRATE = {1: "ALTER TABLE sessions ADD COLUMN conversation TEXT NOT NULL DEFAULT ''",
            2: "ALTER TABLE sessions ADD COLUMN media BLOB NOT NULL DEFAULT x''",
            3: "ALTER TABLE sessions ADD COLUMN state_ends TEXT NOT NULL DEFAULT '[]'",
            4: _WARM_SCHEMA}
# Pending-operation names of warm prompts (no session id starts with a NUL).
_WARM = '\0warm:'
_WAL_LIMIT = 32 << 20  # bytes the WAL file is truncated to after a checkpoint
_HASHED = ('model.yaml', 'model.onnx')
_FIX = ('point sessions.store at another file, delete this one (its saved sessions are lost), '
        "or set sessions.store to '' to keep sessions in memory only")


class SessionStoreError(ModelLoadError):
    """sessions.store cannot be used: not writable, corrupt, foreign or in use."""


def model_hash(model_dir: str) -> str:
    """Identity of the weights a KV prefix was computed with (docs/sessions.md).

    sha256 of model.yaml and model.onnx (the graph, ~0.2 MB) plus the name, size and mtime of
    every *.data file: hashing the weights themselves costs ~0.1 s per 100 MB (1-4 s per
    configure for 1.5B-7B models), while a converter or an update always writes new data
    files. A copied folder (new mtimes) therefore drops its sessions: safe, never wrong.
    """
    root = pathlib.Path(model_dir)
    digest = hashlib.sha256()
    for name in _HASHED:
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b'\0' + path.read_bytes() + b'\0')
    for path in sorted(root.glob('*.data')):
        st = path.stat()
        digest.update(f'{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0'.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class KVLayout:
    """What a saved prefix's bytes mean: buffer count, heads, head size and dtypes."""

    buffers: int
    kv_heads: int
    head_dim: int
    buffer_dtype: str    # numpy name of the KV buffers' dtype
    snapshot_dtype: str  # 'float32' (= the buffers' dtype) or 'int8'
    # A hybrid's conv states: each layer's state shape [1, kernel - 1, hidden], and their dtype.
    states: Tuple[Tuple[int, ...], ...] = ()
    state_dtype: str = ''

    @classmethod
    def of(cls, buffers: Sequence[np.ndarray], snapshot_dtype: str,
           states: Sequence[np.ndarray] = ()) -> 'KVLayout':
        b = buffers[0]
        if any((x.shape[1], x.shape[3]) != (b.shape[1], b.shape[3]) for x in buffers):
            from edge_llm_ros.errors import UnsupportedModelError
            raise UnsupportedModelError(
                'the persistent session store keeps KV layers of one shape; this model '
                '(gemma4) has layers of different heads: leave engine.session_store unset '
                '(in-memory sessions work)')
        # Live int8 buffers (a decoder of kv.dtype int8) hold the rows an int8 snapshot of the
        # op's float32 buffers holds: the same BLOB, so the same layout (rows stay readable).
        dtype = 'float32' if b.dtype == np.int8 else np.dtype(b.dtype).name
        return cls(len(buffers), int(b.shape[1]), int(b.shape[3]), dtype,
                   snapshot_dtype, tuple(tuple(int(d) for d in s.shape) for s in states),
                   np.dtype(states[0].dtype).name if len(states) else '')

    def text(self) -> str:
        fields: List[Any] = [self.buffers, self.kv_heads, self.head_dim, self.buffer_dtype,
                             self.snapshot_dtype]
        if self.states:   # a layout of KV only reads as before conv states existed
            fields += [[list(s) for s in self.states], self.state_dtype]
        return json.dumps(fields)

    def nbytes(self, positions: int, ends: int = 0) -> int:
        """Bytes of a row of this many positions with conv states at `ends` kept ends."""
        rows = self.buffers * self.kv_heads * positions
        if self.snapshot_dtype == 'int8':
            kv = rows * (self.head_dim + 4)
        else:
            kv = rows * self.head_dim * np.dtype(self.buffer_dtype).itemsize
        return kv + ends * self._state_set_nbytes()

    def _state_set_nbytes(self) -> int:
        if not self.states:
            return 0
        return sum(int(np.prod(s)) for s in self.states) * np.dtype(self.state_dtype).itemsize

    def decode(self, keys: Tuple[Hashable, ...], blob: bytes,
               ends: Sequence[int] = ()) -> _Snapshot:
        """Snapshot of a row's blob and kept ends (ValueError when they do not match)."""
        n = len(keys)
        if bool(self.states) != bool(ends) or any(not 0 < m <= n for m in ends) \
                or list(ends) != sorted(set(ends)):
            raise ValueError(f'conv states kept at {list(ends)} for {n} positions')
        kv_bytes = self.nbytes(n)
        if len(blob) != self.nbytes(n, len(ends)):
            raise ValueError(f'{len(blob)} bytes for {n} positions, expected '
                             f'{self.nbytes(n, len(ends))}')
        quantized = self.snapshot_dtype == 'int8'
        dtype = np.dtype(np.int8) if quantized else np.dtype(self.buffer_dtype)
        shape = (1, self.kv_heads, n, self.head_dim)
        step = int(np.prod(shape)) * dtype.itemsize
        data = [np.frombuffer(blob, dtype, int(np.prod(shape)), i * step).reshape(shape)
                for i in range(self.buffers)]
        scales = None
        if quantized:
            base, count = self.buffers * step, self.kv_heads * n
            scales = [np.frombuffer(blob, np.float32, count, base + i * count * 4).reshape(
                (1, self.kv_heads, n, 1)) for i in range(self.buffers)]
        states: Dict[int, List[np.ndarray]] = {}
        offset, dtype = kv_bytes, np.dtype(self.state_dtype or 'float32')
        for m in ends:
            states[m] = []
            for shape in self.states:
                count = int(np.prod(shape))
                states[m].append(np.frombuffer(blob, dtype, count, offset).reshape(shape))
                offset += count * dtype.itemsize
        return _Snapshot(keys, data, scales, states)


def encode_keys(keys: Sequence[Hashable]) -> str:
    """JSON of position keys: ints stay ints, ('img', digest, i) becomes ['img', digest, i]."""
    return json.dumps([k if isinstance(k, int) else list(k) for k in keys],
                      separators=(',', ':'))


def decode_keys(text: str) -> Tuple[Hashable, ...]:
    """Inverse of encode_keys (ValueError for anything it would not have written)."""
    out: List[Hashable] = []
    for k in json.loads(text):
        if isinstance(k, int) and not isinstance(k, bool):
            out.append(k)
        elif (isinstance(k, list) and len(k) == 3 and k[0] in ('emb', 'img', 'lora')
              and isinstance(k[1], str) and isinstance(k[2], int)):
            out.append((k[0], k[1], k[2]))
        else:
            raise ValueError(f'unknown position key {k!r}')
    return tuple(out)


def _ends(text: str) -> List[int]:
    """Kept ends of a row's state_ends column (ValueError for anything not written here)."""
    ends = json.loads(text)
    if not isinstance(ends, list) or not all(
            isinstance(m, int) and not isinstance(m, bool) for m in ends):
        raise ValueError(f'state_ends {text!r} is not a list of positions')
    return ends


def _blob(snap: _Snapshot) -> bytes:
    parts = list(snap.data) + list(snap.scales or [])
    parts += [a for m in sorted(snap.states) for a in snap.states[m]]
    return b''.join(memoryview(np.ascontiguousarray(a)).cast('B') for a in parts)


@dataclass
class _Row:
    session_id: str
    model_hash: str
    converter_version: str
    layout: str
    positions: int
    nbytes: int
    tick: int


class SessionStore:
    """The SQLite file: validated at open, written by one background thread (a SnapshotSink)."""

    def __init__(self, path: str, model_id: str, layout: KVLayout) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.model_id = model_id
        self.layout = layout
        self._layout_text = layout.text()
        self._lock_file = self._acquire_lock()
        try:
            self._db = self._connect()
        except BaseException:
            self._lock_file.close()
            raise
        self._cond = threading.Condition()
        self._pending: Dict[str, Tuple[str, Optional[_Snapshot], Optional[Conversation],
                                       int]] = {}
        self._clear = False
        self._busy = False
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        # Durability barrier: every recorded change gets a number; _written is the last one
        # on disk (or failed: the error is logged and counted). when_written() waits on it.
        self._recorded = 0
        self._written = 0
        self._waiters: List[Tuple[int, Callable[[], None]]] = []
        self.stats = {'batches': 0, 'saves': 0, 'coalesced': 0, 'errors': 0}
        self.last_error = ''
        # Warm prompts read back by restore_warm: key -> snapshot (this model's rows only).
        self.warm_rows: Dict[str, _Snapshot] = {}
        # ... and the rows it dropped: key -> why (warm_row raises it).
        self.warm_errors: Dict[str, StoredWarmStateError] = {}
        self._warm_keys: set = set()   # every key with a row on disk

    # --- opening -----------------------------------------------------------------------------
    def _acquire_lock(self):
        """Hold <path>.lock for the store's life (two nodes on one file: an error).

        Two nodes on one file would delete each other's sessions. The kernel drops the lock
        when the process dies (even by kill -9).
        """
        parent = os.path.dirname(self.path)
        try:
            if os.path.isdir(self.path):
                raise IsADirectoryError(f'{self.path} is a directory')
            os.makedirs(parent, exist_ok=True)
            lock_file = open(self.path + '.lock', 'a+b')
        except OSError as exc:
            raise SessionStoreError(
                f'sessions.store {self.path} cannot be written ({exc}): choose a writable '
                "file path (its folder is created if missing), or set sessions.store to ''"
            ) from None
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            raise SessionStoreError(
                f'sessions.store {self.path} is in use by another process: give every node its '
                'own sessions.store file') from None
        return lock_file

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise SessionStoreError(f'sessions.store {self.path} cannot be opened ({exc}): '
                                    "choose a writable file path, or set sessions.store to ''"
                                    ) from None
        try:
            self._check_and_init(db)
        except sqlite3.DatabaseError as exc:
            db.close()
            text = str(exc)
            if 'readonly' in text or 'unable to open' in text or 'disk I/O' in text:
                raise SessionStoreError(
                    f'sessions.store {self.path} cannot be written ({text}): choose a '
                    "writable file path, or set sessions.store to ''") from None
            raise SessionStoreError(f'sessions.store {self.path} is not a valid SQLite file '
                                    f'({text}): {_FIX}') from None
        except SessionStoreError:
            db.close()
            raise
        return db

    def _check_and_init(self, db: sqlite3.Connection) -> None:
        app_id = db.execute('PRAGMA application_id').fetchone()[0]
        version = db.execute('PRAGMA user_version').fetchone()[0]
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        if app_id == 0 and not tables:  # a new (or empty) file: make it ours
            db.execute('PRAGMA auto_vacuum = FULL')  # freed pages go back to the filesystem
            db.execute(f'PRAGMA application_id = {APPLICATION_ID}')
            db.execute(f'PRAGMA user_version = {SCHEMA_VERSION}')
            db.execute(_SCHEMA)
            db.execute(_WARM_SCHEMA)
        elif app_id != APPLICATION_ID:
            raise SessionStoreError(
                f'sessions.store {self.path} is an SQLite file of another application '
                f'(application_id {app_id:#x}, tables {", ".join(tables[:5]) or "none"}), not '
                f'an edge_llm_ros session store: {_FIX}')
        elif version in _MIGRATE and 'sessions' in tables:
            db.execute('BEGIN IMMEDIATE')
            for step in range(version, SCHEMA_VERSION):
                db.execute(_MIGRATE[step])
            db.execute(f'PRAGMA user_version = {SCHEMA_VERSION}')
            db.execute('COMMIT')
            _log.info('sessions.store %s: upgraded from schema %d (sessions kept)', self.path,
                      version)
        elif version != SCHEMA_VERSION:
            raise SessionStoreError(
                f'sessions.store {self.path} has schema version {version}, this edge_llm_ros '
                f'reads version {SCHEMA_VERSION}: {_FIX}')
        mode = db.execute('PRAGMA journal_mode = WAL').fetchone()[0]
        if str(mode).lower() != 'wal':
            raise SessionStoreError(f'sessions.store {self.path}: SQLite refused WAL mode '
                                    f'(got {mode}; a network filesystem?): {_FIX}')
        db.execute('PRAGMA synchronous = NORMAL')  # WAL: a crash never corrupts the file
        db.execute(f'PRAGMA journal_size_limit = {_WAL_LIMIT}')
        bad = db.execute('PRAGMA quick_check').fetchone()[0]
        if bad != 'ok':
            raise SessionStoreError(f'sessions.store {self.path} is corrupt ({bad}): {_FIX}')
        columns = {r[1] for r in db.execute('PRAGMA table_info(sessions)')}
        wanted = set(_Row.__dataclass_fields__) | {
            'keys', 'data', 'conversation', 'media', 'state_ends'}
        warm = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND "
                          "name='warm_prompts'").fetchone()
        if not wanted <= columns or warm is None:
            raise SessionStoreError(f'sessions.store {self.path} lacks the sessions table '
                                    f'columns of schema {SCHEMA_VERSION}: {_FIX}')
        db.execute('BEGIN IMMEDIATE')  # proves the file is writable now, not at the first save
        db.execute('COMMIT')

    # --- restoring ---------------------------------------------------------------------------
    def restore_into(self, snaps: SnapshotStore, capacity: int) -> int:
        """Load the rows that fit this model into snaps (oldest first); deal with the others.

        A row whose KV this model cannot use (another model, converter version, KV layout,
        or longer than the context) keeps its conversation as text (Conversation.as_text,
        written back for this model): its next turn prefills it afresh. Rows without a
        conversation, unreadable ones and those beyond the bounds are deleted. Logs one
        line: how many were restored, kept as text, and dropped, and why. Returns the number
        restored with their KV.
        """
        rows = [_Row(*r) for r in self._db.execute(
            'SELECT session_id, model_hash, converter_version, layout, positions, nbytes, tick'
            ' FROM sessions ORDER BY tick DESC')]
        why: Dict[str, int] = {}
        as_text: Dict[str, int] = {}
        keep: List[Tuple[_Row, Optional[str]]] = []   # (row, why its KV goes, or None)
        used = 0
        for row in rows:  # newest first: the bounds keep the most recently used
            reason = self._mismatch(row, capacity)
            weight = row.nbytes if reason is None else 0
            if not (len(keep) < snaps.max_sessions and (
                    snaps.max_bytes is None or used + weight <= snaps.max_bytes)):
                reason = 'over the kv.max_sessions / sessions.max_bytes bound'
                why[reason] = why.get(reason, 0) + 1
                continue
            keep.append((row, reason))
            used += weight
        restored = 0
        kept = set()
        for row, reason in reversed(keep):
            (keys_text, blob, text, media, ends_text), = self._db.execute(
                'SELECT keys, data, conversation, media, state_ends FROM sessions '
                'WHERE session_id = ?', (row.session_id,))
            try:
                conversation = Conversation.from_json(text, bytes(media)) if text else None
                snap = None
                if reason is None:
                    keys = decode_keys(keys_text)
                    if len(keys) != row.positions:
                        raise ValueError(f'{len(keys)} keys for {row.positions} positions')
                    snap = self.layout.decode(keys, blob, _ends(ends_text)) if keys else None
            except ValueError as exc:
                reason = f'unreadable ({exc})'
                why[reason] = why.get(reason, 0) + 1
                continue
            if reason is not None:
                if conversation is None:   # a KV prefix alone: nothing left to keep
                    why[reason] = why.get(reason, 0) + 1
                    continue
                conversation = conversation.as_text()
            if not snaps.load(row.session_id, snap, conversation, row.tick):
                why['empty'] = why.get('empty', 0) + 1
                continue
            kept.add(row.session_id)
            if reason is None:
                restored += 1
            else:   # written back as this model's row: text only, no KV
                as_text[reason] = as_text.get(reason, 0) + 1
                self.save(row.session_id, None, conversation, row.tick)
        dropped = [r.session_id for r in rows if r.session_id not in kept]
        if dropped:
            self._db.execute('BEGIN IMMEDIATE')
            self._db.executemany('DELETE FROM sessions WHERE session_id = ?',
                                 [(d,) for d in dropped])
            self._db.execute('COMMIT')
        line = 'sessions.store %s: restored %d saved sessions (%d bytes)' % (
            self.path, restored, snaps.nbytes())
        if as_text:
            line += ', kept %d as text only (their next turn prefills them again): %s' % (
                sum(as_text.values()), '; '.join(f'{n} {r}' for r, n in as_text.items()))
        if dropped:
            line += ', dropped %d: %s' % (len(dropped),
                                          '; '.join(f'{n} {r}' for r, n in why.items()))
        _log.log(logging.WARNING if dropped or as_text else logging.INFO, line)
        return restored

    def restore_warm(self, capacity: int) -> int:
        """Read the warm prompts' rows into warm_rows; drop the others, one log line each.

        A row of another model, converter version or KV layout (or longer than the context,
        or unreadable) is deleted, and its StoredWarmStateError kept for warm_row() to raise:
        the engine prefills that prompt again, saves it anew and reports why. Returns the
        number read back.
        """
        for key, model_id, version, layout, keys_text, blob, ends_text in self._db.execute(
                'SELECT key, model_hash, converter_version, layout, keys, data, state_ends '
                'FROM warm_prompts'):
            try:
                self.warm_rows[key] = self._read_warm_row(
                    _Row(key, model_id, version, layout, 0, 0, 0), keys_text, blob, ends_text,
                    capacity)
            except StoredWarmStateError as exc:
                self.warm_errors[key] = exc
                _log.warning('%s', exc)
                self._db.execute('BEGIN IMMEDIATE')
                self._db.execute('DELETE FROM warm_prompts WHERE key = ?', (key,))
                self._db.execute('COMMIT')
            else:
                self._warm_keys.add(key)
        return len(self.warm_rows)

    def _read_warm_row(self, row: _Row, keys_text: str, blob: bytes, ends_text: str,
                       capacity: int) -> _Snapshot:
        """Decode one warm prompt's row (StoredWarmStateError when this model cannot use it)."""
        keys: Tuple[Hashable, ...] = ()
        try:
            keys = decode_keys(keys_text)
        except ValueError as exc:
            reason: Optional[str] = f'unreadable ({exc})'
        else:
            row.positions = len(keys)
            reason = self._mismatch(row, capacity)
        if reason is None:
            try:
                return self.layout.decode(keys, blob, _ends(ends_text))
            except ValueError as exc:
                reason = f'unreadable ({exc})'
        raise StoredWarmStateError(
            f'sessions.store {self.path}: the stored warm prompt {row.session_id} '
            f'({len(keys)} tokens) is {reason}. It was written for model hash '
            f'{row.model_hash[:16]} by converter version {row.converter_version} with KV '
            f'layout {row.layout}; this is model hash {self.model_id[:16]}, converter version '
            f'{CONVERTER_VERSION}, KV layout {self._layout_text}. Its KV is dropped and the '
            'prompt is prefilled again at configure (if it is still configured) and saved '
            'anew: nothing to do, unless the model changed by mistake (then point model_dir '
            'back at the model this store was written for)')

    def warm_row(self, key: str) -> Optional[_Snapshot]:
        """Return the warm prompt's snapshot read back at open (None: none stored).

        Raises StoredWarmStateError (once) when its row was stored but could not be used.
        """
        error = self.warm_errors.pop(key, None)
        if error is not None:
            raise error
        return self.warm_rows.get(key)

    def save_warm(self, key: str, snap: _Snapshot) -> None:
        """Record a warm prompt's row (written by the writer thread, as a session's)."""
        self._warm_keys.add(key)
        self._record(_WARM + key, ('warm', snap, None, 0))

    def keep_warm(self, keys: Sequence[str]) -> None:
        """Delete the rows of every warm prompt but these (no longer configured)."""
        for key in sorted(self._warm_keys - set(keys)):
            self._warm_keys.discard(key)
            self._record(_WARM + key, ('unwarm', None, None, 0))

    def _record(self, name: str, op: Tuple[str, Optional[_Snapshot], Optional[Conversation],
                                           int]) -> None:
        with self._cond:
            self._pending[name] = op
            self._recorded += 1
            self._cond.notify_all()

    def _mismatch(self, row: _Row, capacity: int) -> Optional[str]:
        if row.model_hash != self.model_id:
            return 'of another model (model hash differs)'
        if row.converter_version != CONVERTER_VERSION:
            return f'of converter version {row.converter_version} (now {CONVERTER_VERSION})'
        if row.layout != self._layout_text:
            return 'of another KV layout or kv.dtype'
        if row.positions > capacity:
            return f'longer than kv.max_context {capacity}'
        return None

    # --- the SnapshotSink side (called under the engine's lock: only records) ----------------
    def save(self, session_id: str, snap: Optional[_Snapshot],
             conversation: Optional[Conversation], tick: int) -> None:
        with self._cond:
            if session_id in self._pending:
                self.stats['coalesced'] += 1
            self._pending[session_id] = ('save', snap, conversation, tick)
            self._recorded += 1
            self._cond.notify_all()

    def touch(self, session_id: str, tick: int) -> None:
        with self._cond:
            op = self._pending.get(session_id)
            if op is None or op[0] == 'touch':
                self._pending[session_id] = ('touch', None, None, tick)
            elif op[0] == 'save':
                self._pending[session_id] = ('save', op[1], op[2], tick)
            self._recorded += 1
            self._cond.notify_all()

    def delete(self, session_id: str) -> None:
        with self._cond:
            self._pending[session_id] = ('delete', None, None, 0)
            self._recorded += 1
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:   # the warm prompts' rows stay (and their pending writes)
            self._pending = {k: op for k, op in self._pending.items() if k.startswith(_WARM)}
            self._clear = True
            self._recorded += 1
            self._cond.notify_all()

    # --- the writer thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name='session-store-writer',
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._clear or self._closing):
                    self._cond.wait()
                if not (self._pending or self._clear):
                    return  # closing, nothing left
                batch, self._pending = self._pending, {}
                clear, self._clear = self._clear, False
                upto = self._recorded
                self._busy = True
            try:
                self._write(batch, clear)
            except (sqlite3.Error, OSError, ValueError, MemoryError) as exc:  # e.g. disk full
                self.stats['errors'] += 1
                self.last_error = f'{type(exc).__name__}: {exc}'
                _log.error('sessions.store %s: writing %d sessions failed (%s): they stay in '
                           'memory only until their next save; free disk space or move '
                           'sessions.store', self.path, len(batch), exc)
                if self._db.in_transaction:
                    self._db.execute('ROLLBACK')
            finally:
                with self._cond:
                    self._busy = False
                    ready = self._mark_written(upto)
                    self._cond.notify_all()
                for done in ready:
                    done()

    def _write(self, batch: Dict[str, Tuple[str, Optional[_Snapshot], Optional[Conversation],
                                            int]], clear: bool) -> None:
        """Commit a batch: each save in its own transaction, touches and deletes together.

        A kill -9 therefore loses at most the save being written.
        """
        db = self._db
        if clear:
            db.execute('BEGIN IMMEDIATE')
            db.execute('DELETE FROM sessions')
            db.execute('COMMIT')
        small = []
        for session_id, (kind, snap, conversation, tick) in batch.items():
            if kind == 'warm':
                self._write_warm(session_id[len(_WARM):], snap)
                continue
            if kind != 'save':
                small.append((session_id, kind, tick))
                continue
            keys = snap.keys if snap is not None else ()
            db.execute('BEGIN IMMEDIATE')
            db.execute(f'INSERT OR REPLACE INTO sessions ({_COLUMNS}) '
                       'VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
                       (session_id, self.model_id, CONVERTER_VERSION, self._layout_text,
                        encode_keys(keys), len(keys), snap.nbytes if snap is not None else 0,
                        tick, _blob(snap) if snap is not None else b'',
                        conversation.to_json() if conversation is not None else '',
                        conversation.media_bytes() if conversation is not None else b'',
                        json.dumps(sorted(snap.states) if snap is not None else [])))
            db.execute('COMMIT')
            self.stats['saves'] += 1
        if small:
            db.execute('BEGIN IMMEDIATE')
            for session_id, kind, tick in small:
                if kind == 'touch':
                    db.execute('UPDATE sessions SET tick = ? WHERE session_id = ?',
                               (tick, session_id))
                elif kind == 'unwarm':
                    db.execute('DELETE FROM warm_prompts WHERE key = ?',
                               (session_id[len(_WARM):],))
                else:
                    db.execute('DELETE FROM sessions WHERE session_id = ?', (session_id,))
            db.execute('COMMIT')
        self.stats['batches'] += 1

    def _write_warm(self, key: str, snap: _Snapshot) -> None:
        self._db.execute('BEGIN IMMEDIATE')
        self._db.execute('INSERT OR REPLACE INTO warm_prompts (key, model_hash, '
                         'converter_version, layout, keys, data, state_ends) '
                         'VALUES (?, ?, ?, ?, ?, ?, ?)',
                         (key, self.model_id, CONVERTER_VERSION, self._layout_text,
                          encode_keys(snap.keys), _blob(snap), json.dumps(sorted(snap.states))))
        self._db.execute('COMMIT')
        self.stats['saves'] += 1

    def when_written(self, done: Callable[[], None]) -> None:
        """Call done() once every change recorded so far is written (or failed, logged).

        From the writer thread; at once when nothing is pending. A goal's result waits on
        it, so a turn a client saw is on disk (serving/worker.py).
        """
        with self._cond:
            if self._written < self._recorded:
                self._waiters.append((self._recorded, done))
                return
        done()

    def _mark_written(self, upto: int) -> List[Callable[[], None]]:
        """Record that changes up to `upto` are written; return the waiters now due (locked)."""
        self._written = max(self._written, upto)
        ready = [done for mark, done in self._waiters if mark <= self._written]
        self._waiters = [(mark, done) for mark, done in self._waiters if mark > self._written]
        return ready

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything recorded so far is committed; False on timeout."""
        with self._cond:
            if self._thread is None:
                return not (self._pending or self._clear)
            return self._cond.wait_for(
                lambda: not (self._pending or self._clear or self._busy), timeout)

    def close(self) -> None:
        """Commit what is pending, stop the writer, close the file and release the lock."""
        if self._thread is not None:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        elif self._pending or self._clear:
            self._run_pending_inline()
        with self._cond:
            ready = self._mark_written(self._recorded)
        for done in ready:
            done()
        try:
            self._db.close()
        finally:
            self._lock_file.close()

    def discard(self) -> None:
        """Close without writing what is pending (the file could not be read)."""
        self._pending.clear()
        self._clear = False
        self.close()

    def _run_pending_inline(self) -> None:
        batch, self._pending = self._pending, {}
        clear, self._clear = self._clear, False
        self._write(batch, clear)


def open_sessions(config: Any, model_dir: str, buffers: Sequence[np.ndarray],
                  capacity: int, states: Sequence[np.ndarray] = ()) -> SnapshotStore:
    """Build the SnapshotStore an Engine's caches share, restored from config.session_store.

    buffers and states: one slot's KV views and conv-state views (what a row's bytes hold).
    config: an EngineConfig (reads kv_dtype, prefix_reuse, max_sessions, session_max_bytes,
    session_store). Raises SessionStoreError (a ModelLoadError) saying what to do.
    """
    max_sessions = config.max_sessions if config.prefix_reuse else 0
    max_bytes = config.session_max_bytes
    if max_bytes < 0:
        raise SessionStoreError(f'session_max_bytes must be >= 0, got {max_bytes}')
    if not config.session_store:
        return SnapshotStore(max_sessions, max_bytes)
    if max_sessions == 0 or max_bytes == 0:
        raise SessionStoreError(
            'sessions.store is set but no session prefix can be kept (kv.prefix_reuse false, '
            'kv.max_sessions 0 or sessions.max_bytes 0): enable them, or set sessions.store '
            "to ''")
    sink = SessionStore(config.session_store, model_hash(model_dir),
                        KVLayout.of(buffers, config.kv_dtype, states))
    snaps = SnapshotStore(max_sessions, max_bytes, sink=sink)
    try:
        sink.restore_into(snaps, capacity)
        sink.restore_warm(capacity)
    except sqlite3.DatabaseError as exc:
        sink.discard()
        raise SessionStoreError(f'sessions.store {sink.path} could not be read ({exc}): '
                                f'{_FIX}') from None
    sink.start()
    return snaps
