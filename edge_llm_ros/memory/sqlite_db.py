"""A SQLite connection with the sqlite-vec extension loaded.

Python's own sqlite3 is used when it can load extensions (Ubuntu's and Debian's python3 can).
Some builds cannot (pyenv's default, some containers): then pysqlite3 (PyPI pysqlite3-binary,
a sqlite3 with the same API) is used, and without it MemoryStoreError says what to install.
The choice is made once per process and is logged.
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Optional

from edge_llm_ros.memory.errors import MemoryStoreError

_log = logging.getLogger(__name__)
_MODULE: Optional[ModuleType] = None


def sqlite_module() -> ModuleType:
    """Return the DB-API module whose connections can load sqlite-vec."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    import sqlite3
    if hasattr(sqlite3.Connection, 'enable_load_extension'):
        _MODULE = sqlite3
        return _MODULE
    try:
        from pysqlite3 import dbapi2
    except ImportError:
        raise MemoryStoreError(
            "this Python's sqlite3 cannot load extensions (built without "
            '--enable-loadable-sqlite-extensions), so sqlite-vec cannot be loaded: '
            'pip install pysqlite3-binary (x86_64), or run with a Python whose sqlite3 can '
            "(Ubuntu's python3)") from None
    _log.info("this Python's sqlite3 cannot load extensions: memory uses pysqlite3 "
              '(SQLite %s)', dbapi2.sqlite_version)
    _MODULE = dbapi2
    return _MODULE


def connect(path: str, timeout: float = 5.0) -> Any:
    """Open `path` with sqlite-vec loaded; MemoryStoreError says why it cannot be."""
    module = sqlite_module()
    try:
        import sqlite_vec
    except ImportError:
        raise MemoryStoreError('sqlite-vec is not installed: pip install sqlite-vec '
                               '(requirements.txt)') from None
    try:
        db = module.connect(path, timeout=timeout, check_same_thread=False,
                            isolation_level=None)
        db.enable_load_extension(True)
        sqlite_vec.load(db)
        db.enable_load_extension(False)
    except module.Error as exc:
        raise MemoryStoreError(f'cannot open memory store {path}: {exc}; point memory.store '
                               'at a writable file') from None
    return db
