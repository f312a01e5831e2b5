"""The memory store: rows in SQLite (WAL), their vectors in a sqlite-vec vec0 table.

* A row: id, text, stamp (seconds since the epoch), tags, an optional pose (x, y, z in metres
  plus an orientation quaternion, in a frame id), and its vector in `vectors` (same rowid).
  The store records the model id and dimensions of its vectors (table meta): check_model()
  refuses another model with the command that re-embeds the store (memory/reembed.py).
* Durable: every add() and forget() is one transaction committed with synchronous=FULL
  before it returns, so every acknowledged write survives kill -9 (and power loss).
* Bounded: after an add, the oldest rows (lowest ids) are deleted in the same transaction
  until the store holds at most max_rows rows and max_bytes bytes of payload (text, tags,
  vector and fixed columns per row: row_nbytes()). add() returns how many were evicted; one
  log line names them.
* search(): cosine distance. Without filters, the vec0 KNN query; with filters (time window,
  tags, distance from a pose in the same frame), an exact scan of the rows the filters keep,
  over a second copy of each vector in its row: a vec0 lookup by rowid reads its chunk (~65 us
  a row), the row's own copy ~1 us. Rows therefore count 8 bytes per dimension.
* One process per store file (<path>.lock, dropped by the kernel even on kill -9).
"""
from __future__ import annotations

from dataclasses import dataclass
import fcntl
import json
import logging
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.memory.errors import (InvalidMemoryRequestError, MemoryStoreError,
                                        StoreModelMismatchError)
from edge_llm_ros.memory.sqlite_db import connect, sqlite_module

_log = logging.getLogger(__name__)
APPLICATION_ID = 0x454C4D4D  # 'ELMM': PRAGMA application_id of an edge_llm_ros memory store
SCHEMA_VERSION = 1
ROW_OVERHEAD = 96            # bytes counted per row for its id, stamp, pose and index entries
REEMBED_COMMAND = 'edge-llm-memory-reembed --store {path} --embed-service <embed node>/embed'
_SCHEMA = (
    'CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)',
    'CREATE TABLE IF NOT EXISTS memories (id INTEGER PRIMARY KEY AUTOINCREMENT, '
    'text TEXT NOT NULL, stamp REAL NOT NULL, tags TEXT NOT NULL, frame_id TEXT, '
    'x REAL, y REAL, z REAL, qx REAL, qy REAL, qz REAL, qw REAL, nbytes INTEGER NOT NULL, '
    'embedding BLOB NOT NULL)',
    'CREATE INDEX IF NOT EXISTS memories_stamp ON memories (stamp)',
    'CREATE INDEX IF NOT EXISTS memories_place ON memories (frame_id, x)',
    'CREATE TABLE IF NOT EXISTS memory_tags (tag TEXT NOT NULL, id INTEGER NOT NULL, '
    'PRIMARY KEY (tag, id)) WITHOUT ROWID',
)
_ROW = 'id, text, stamp, tags, frame_id, x, y, z, qx, qy, qz, qw'


@dataclass(frozen=True)
class StoreConfig:
    """Where the store lives and how much it may hold."""

    path: str
    max_rows: int = 100_000
    max_bytes: int = 512 << 20


@dataclass(frozen=True)
class Pose:
    """A position (metres) and orientation (unit quaternion) in frame_id."""

    frame_id: str
    x: float
    y: float
    z: float
    qx: float = 0.0
    qy: float = 0.0
    qz: float = 0.0
    qw: float = 1.0


# The columns of a row without a pose (SQL NULLs).
_NO_POSE = Pose(None, None, None, None, None, None, None, None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Filters:
    """What recall keeps before ranking; the defaults keep everything."""

    tags: Tuple[str, ...] = ()          # every one of these tags
    since: Optional[float] = None       # stamp >= since (seconds since the epoch)
    until: Optional[float] = None       # stamp <= until
    near: Optional[Pose] = None         # posed in near.frame_id ...
    radius_m: float = 0.0               # ... within this distance of near's position

    def active(self) -> bool:
        return bool(self.tags) or self.since is not None or self.until is not None or \
            self.near is not None


@dataclass(frozen=True)
class Hit:
    """One stored memory, with its distance to the query when it comes from search()."""

    id: int  # noqa: A003 (the row's name in the store)
    text: str
    stamp: float
    tags: Tuple[str, ...]
    pose: Optional[Pose]
    distance: float = 0.0


def row_nbytes(text: str, tags: Sequence[str], dimensions: int) -> int:
    """Bytes one row counts against max_bytes."""
    return len(text.encode()) + len(json.dumps(list(tags)).encode()) + 8 * dimensions + \
        ROW_OVERHEAD


class MemoryStore:
    """One memory store file; every method is safe to call from several threads."""

    def __init__(self, config: StoreConfig) -> None:
        import threading
        self.config = config
        self.path = os.path.abspath(config.path)
        self._lock = threading.Lock()
        self._lock_file = self._acquire_lock()
        try:
            self._db = connect(self.path)
            self._init()
        except BaseException:
            self._lock_file.close()
            raise
        self.model_id, self.dimensions = self._identity()
        row = self._db.execute('SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM memories'
                               ).fetchone()
        self.rows, self.nbytes = int(row[0]), int(row[1])

    # --- opening -------------------------------------------------------------------------------
    def _acquire_lock(self) -> Any:
        try:
            if os.path.isdir(self.path):
                raise IsADirectoryError(f'{self.path} is a directory')
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            lock_file = open(self.path + '.lock', 'a+b')
        except OSError as exc:
            raise MemoryStoreError(f'memory store {self.path} cannot be written ({exc}): '
                                   'point memory.store at a writable file') from None
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock_file.close()
            raise MemoryStoreError(f'memory store {self.path} is in use by another process: '
                                   'give every memory node its own memory.store') from None
        return lock_file

    def _init(self) -> None:
        db, errors = self._db, sqlite_module().DatabaseError
        try:
            app_id = db.execute('PRAGMA application_id').fetchone()[0]
            tables = db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'"
                                ).fetchone()[0]
            if app_id == 0 and tables == 0:
                db.execute(f'PRAGMA application_id = {APPLICATION_ID}')
                db.execute(f'PRAGMA user_version = {SCHEMA_VERSION}')
            elif app_id != APPLICATION_ID:
                raise MemoryStoreError(f'{self.path} is not a memory store (another SQLite '
                                       'file): point memory.store at another file')
            mode = db.execute('PRAGMA journal_mode = WAL').fetchone()[0]
            if str(mode).lower() != 'wal':
                raise MemoryStoreError(f'memory store {self.path} cannot use WAL ({mode}): put '
                                       'it on a local filesystem')
            db.execute('PRAGMA synchronous = FULL')   # acknowledged = on disk
            for statement in _SCHEMA:
                db.execute(statement)
        except errors as exc:
            db.close()
            raise MemoryStoreError(f'memory store {self.path} cannot be used ({exc}): point '
                                   'memory.store at another file, or delete this one') from None

    def _identity(self) -> Tuple[str, int]:
        meta = dict(self._db.execute('SELECT key, value FROM meta').fetchall())
        return meta.get('model_id', ''), int(meta.get('dimensions', 0))

    # --- the model -----------------------------------------------------------------------------
    def check_model(self, model_id: str, dimensions: int) -> None:
        """Adopt (empty store) or check the embedding model; StoreModelMismatchError if other."""
        if not model_id or dimensions <= 0:
            raise MemoryStoreError(f'the embedding node named no model id ({model_id!r}) or no '
                                   f'dimensions ({dimensions}): check the embedding node')
        with self._lock:
            if self.dimensions == 0:
                self._create_vectors(model_id, dimensions)
                return
            if (model_id, dimensions) != (self.model_id, self.dimensions):
                raise StoreModelMismatchError(
                    f'memory store {self.path} holds {self.rows} memories embedded by '
                    f'{self.model_id!r} ({self.dimensions} dims), the embedding node now runs '
                    f'{model_id!r} ({dimensions} dims): re-embed the store with `'
                    + REEMBED_COMMAND.format(path=self.path) + '` (memory node stopped), or '
                    'point memory.store at a new file')

    def _create_vectors(self, model_id: str, dimensions: int) -> None:
        db = self._db
        db.execute('BEGIN IMMEDIATE')
        try:
            db.execute(f'CREATE VIRTUAL TABLE vectors USING vec0(embedding float[{dimensions}] '
                       'distance_metric=cosine)')
            db.executemany('INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)',
                           [('model_id', model_id), ('dimensions', str(dimensions))])
            db.execute('COMMIT')
        except BaseException:
            db.execute('ROLLBACK')
            raise
        self.model_id, self.dimensions = model_id, dimensions
        _log.info('memory store %s: vectors of %s (%d dims)', self.path, model_id, dimensions)

    def _vector(self, vector: np.ndarray) -> bytes:
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        if vec.size != self.dimensions:
            raise StoreModelMismatchError(f'a vector of {vec.size} dims for a store of '
                                          f'{self.dimensions}: check the embedding node')
        if not np.all(np.isfinite(vec)):
            raise InvalidMemoryRequestError('the embedding has NaN or infinite values: check '
                                            'the embedding node')
        return vec.tobytes()

    # --- writes --------------------------------------------------------------------------------
    def add(self, text: str, vector: np.ndarray, stamp: float, tags: Sequence[str] = (),
            pose: Optional[Pose] = None) -> Tuple[int, int]:
        """Store one row; return (its id, rows evicted). Durable when it returns."""
        ids, evicted = self.add_many([(text, vector, stamp, tags, pose)])
        return ids[0], evicted

    def add_many(self, rows: Sequence[Tuple[str, np.ndarray, float, Sequence[str],
                                            Optional[Pose]]]) -> Tuple[List[int], int]:
        """Store rows (text, vector, stamp, tags, pose) in one transaction; (ids, evicted)."""
        prepared = []
        for text, vector, stamp, tags, pose in rows:
            tags = tuple(dict.fromkeys(tags))
            nbytes = row_nbytes(text, tags, self.dimensions)
            if nbytes > self.config.max_bytes:
                raise InvalidMemoryRequestError(
                    f'one memory of {nbytes} bytes is over the store bound of '
                    f'{self.config.max_bytes} bytes: shorten the text or raise memory.max_bytes')
            p = pose or _NO_POSE
            prepared.append(((text, float(stamp), json.dumps(list(tags)), p.frame_id, p.x, p.y,
                              p.z, p.qx, p.qy, p.qz, p.qw, nbytes), self._vector(vector), tags))
        added = sum(r[0][-1] for r in prepared)
        ids: List[int] = []
        with self._lock:
            db = self._db
            db.execute('BEGIN IMMEDIATE')
            try:
                for columns, blob, tags in prepared:
                    cur = db.execute(
                        'INSERT INTO memories (text, stamp, tags, frame_id, x, y, z, qx, qy, qz, '
                        'qw, nbytes, embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
                        (*columns, blob))
                    row_id = int(cur.lastrowid)
                    db.execute('INSERT INTO vectors (rowid, embedding) VALUES (?, ?)',
                               (row_id, blob))
                    db.executemany('INSERT INTO memory_tags (tag, id) VALUES (?, ?)',
                                   [(t, row_id) for t in tags])
                    ids.append(row_id)
                evicted, freed = self._evict(self.rows + len(ids), self.nbytes + added)
                db.execute('COMMIT')
            except BaseException:
                db.execute('ROLLBACK')
                raise
            self.rows += len(ids) - len(evicted)
            self.nbytes += added - freed
        if evicted:
            _log.info('memory store %s: evicted %d oldest memories (ids %d..%d) to stay within '
                      '%d rows and %d bytes', self.path, len(evicted), evicted[0], evicted[-1],
                      self.config.max_rows, self.config.max_bytes)
        return ids, len(evicted)

    def _evict(self, rows: int, nbytes: int) -> Tuple[List[int], int]:
        """Delete the oldest rows until within bounds (inside the caller's transaction)."""
        victims: List[int] = []
        freed = 0
        cursor = self._db.execute('SELECT id, nbytes FROM memories ORDER BY id')
        while rows - len(victims) > self.config.max_rows or nbytes - freed > self.config.max_bytes:
            row = cursor.fetchone()
            victims.append(int(row[0]))
            freed += int(row[1])
        cursor.close()
        self._delete(victims)
        return victims, freed

    def _delete(self, ids: Sequence[int]) -> None:
        db = self._db
        for start in range(0, len(ids), 500):
            chunk = list(ids[start:start + 500])
            marks = ','.join('?' * len(chunk))
            db.execute(f'DELETE FROM memories WHERE id IN ({marks})', chunk)
            db.execute(f'DELETE FROM memory_tags WHERE id IN ({marks})', chunk)
            if self.dimensions:
                db.execute(f'DELETE FROM vectors WHERE rowid IN ({marks})', chunk)

    def forget(self, ids: Sequence[int] = (), tags: Sequence[str] = (),
               before: Optional[float] = None) -> int:
        """Delete rows with these ids, any of these tags, or a stamp before `before`."""
        where, args = [], []
        if ids:
            where.append(f'id IN ({",".join("?" * len(ids))})')
            args += [int(i) for i in ids]
        if tags:
            where.append(f'id IN (SELECT id FROM memory_tags WHERE tag IN '
                         f'({",".join("?" * len(tags))}))')
            args += list(tags)
        if before is not None:
            where.append('stamp < ?')
            args.append(float(before))
        if not where:
            raise InvalidMemoryRequestError('forget needs ids, tags or an age: give at least '
                                            'one (nothing was deleted)')
        with self._lock:
            db = self._db
            db.execute('BEGIN IMMEDIATE')
            try:
                victims = db.execute(f'SELECT id, nbytes FROM memories WHERE {" OR ".join(where)}',
                                     args).fetchall()
                self._delete([int(r[0]) for r in victims])
                db.execute('COMMIT')
            except BaseException:
                db.execute('ROLLBACK')
                raise
            self.rows -= len(victims)
            self.nbytes -= sum(int(r[1]) for r in victims)
        return len(victims)

    # --- reads ---------------------------------------------------------------------------------
    def frames(self) -> Tuple[str, ...]:
        """Frame ids of the posed memories."""
        with self._lock:
            rows = self._db.execute('SELECT DISTINCT frame_id FROM memories '
                                    'WHERE frame_id IS NOT NULL').fetchall()
        return tuple(sorted(r[0] for r in rows))

    def search(self, vector: np.ndarray, k: int, filters: Filters = Filters()) -> List[Hit]:
        """Return the k rows nearest to `vector` (cosine distance) that pass `filters`."""
        if self.dimensions == 0:
            return []
        blob = self._vector(vector)
        with self._lock:
            if not filters.active():
                found = self._db.execute(
                    'SELECT rowid, distance FROM vectors WHERE embedding MATCH ? AND k = ? '
                    'ORDER BY distance', (blob, int(k))).fetchall()
            else:
                where, args = _where(filters)
                found = self._db.execute(
                    'SELECT m.id, vec_distance_cosine(m.embedding, ?) AS d FROM memories m '
                    f'WHERE {where} ORDER BY d LIMIT ?',
                    [blob, *args, int(k)]).fetchall()
            rows = self._rows([int(r[0]) for r in found])
        return [_hit(rows[int(r[0])], float(r[1])) for r in found if int(r[0]) in rows]

    def _rows(self, ids: Sequence[int]) -> dict:
        if not ids:
            return {}
        marks = ','.join('?' * len(ids))
        return {int(r[0]): r for r in self._db.execute(
            f'SELECT {_ROW} FROM memories WHERE id IN ({marks})', list(ids))}

    def all_rows(self, batch: int = 256) -> Iterator[Hit]:
        """Every row, oldest first (re-embedding reads the texts from here)."""
        last = 0
        while True:
            with self._lock:
                rows = self._db.execute(f'SELECT {_ROW} FROM memories WHERE id > ? ORDER BY id '
                                        'LIMIT ?', (last, batch)).fetchall()
            if not rows:
                return
            for row in rows:
                yield _hit(row, 0.0)
            last = int(rows[-1][0])

    def close(self) -> None:
        """Close the file and release its lock."""
        with self._lock:
            self._db.close()
            self._lock_file.close()


def _where(f: Filters) -> Tuple[str, list]:
    where, args = ['1'], []
    if f.since is not None:
        where.append('m.stamp >= ?')
        args.append(float(f.since))
    if f.until is not None:
        where.append('m.stamp <= ?')
        args.append(float(f.until))
    if f.tags:
        tags = tuple(dict.fromkeys(f.tags))
        for tag in tags:
            where.append('m.id IN (SELECT id FROM memory_tags WHERE tag = ?)')
            args.append(tag)
    if f.near is not None:
        n = f.near
        r = float(f.radius_m)
        # The x range uses the index memories_place; the sphere is exact.
        where.append('m.frame_id = ? AND m.x BETWEEN ? AND ? AND (m.x - ?) * (m.x - ?) + '
                     '(m.y - ?) * (m.y - ?) + (m.z - ?) * (m.z - ?) <= ?')
        args += [n.frame_id, n.x - r, n.x + r, n.x, n.x, n.y, n.y, n.z, n.z, r * r]
    return ' AND '.join(where), args


def _hit(row: Sequence[Any], distance: float) -> Hit:
    pose = None if row[4] is None else Pose(row[4], *(float(v) for v in row[5:12]))
    return Hit(int(row[0]), row[1], float(row[2]), tuple(json.loads(row[3])), pose, distance)
