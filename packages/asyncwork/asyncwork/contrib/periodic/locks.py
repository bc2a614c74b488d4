"""Job locks: PostgreSQL session advisory locks, one per name, and who holds each.

``pg_try_advisory_lock`` never waits: a second run gets False at once and skips. The lock belongs
to the session, so a dead process's lock is released when PostgreSQL sees its connection close:
no lease, no row to clean. All locks share one namespace (the first key), so ``pg_locks`` shows
them together.

``pg_locks`` names only the backend; the taker records its own host and pid in ``LockHolder`` on
the same session, and ``lock_holder`` shows a record only while the session that wrote it
(backend pid and start time) holds the lock. (``application_name`` would cut host names at 63
bytes.)
"""

from __future__ import annotations

import logging
import os
import socket
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, connection

logger = logging.getLogger(__name__)

NAMESPACE = 0x1A5C  # the classid of every advisory lock this application takes


def lock_key(name: str) -> int:
    """A stable signed 32-bit key for a lock name."""
    return zlib.crc32(name.encode()) - 2**31


@dataclass(frozen=True)
class Holder:
    """The process holding a lock; ``pid`` and ``host`` are None until it recorded itself."""

    host: str | None
    pid: int | None

    def __str__(self) -> str:
        if self.pid is None:
            return "held (holder not recorded)"
        return f"pid {self.pid} on host {self.host}"


RECORD_SQL = """
INSERT INTO asyncwork_lockholder (name, host, pid, backend_pid, backend_start, taken_at)
SELECT %s, %s, %s, pid, backend_start, now() FROM pg_stat_activity WHERE pid = pg_backend_pid()
ON CONFLICT (name) DO UPDATE SET host = EXCLUDED.host, pid = EXCLUDED.pid,
    backend_pid = EXCLUDED.backend_pid, backend_start = EXCLUDED.backend_start,
    taken_at = EXCLUDED.taken_at
"""


def lock_holder_record(*, name: str, execute: Callable[[str, list[Any]], object]) -> None:
    """Record this process as holder of lock ``name``, by ``execute`` on the holding session."""
    execute(RECORD_SQL, [name, socket.gethostname(), os.getpid()])


@contextmanager
def advisory_lock(name: str) -> Iterator[bool]:
    """Try to take the named lock on Django's connection; yields whether it was taken. Released on
    exit, or with the session."""
    key = lock_key(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [NAMESPACE, key])
        (held,) = cursor.fetchone()
    try:
        if held:
            # Inside the try: a lock whose record failed is released all the same.
            with connection.cursor() as cursor:
                lock_holder_record(name=name, execute=cursor.execute)
        yield bool(held)
    finally:
        if held:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [NAMESPACE, key])
            except DatabaseError:
                logger.warning("could not release lock %s: its session is gone", name)


def advisory_xact_lock(name: str) -> None:
    """Wait for the named lock and hold it to the end of the current transaction: for work that must
    neither run twice at once nor be skipped."""
    if not connection.in_atomic_block:
        raise RuntimeError("advisory_xact_lock needs a transaction: use transaction.atomic()")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [NAMESPACE, lock_key(name)])


HOLDER_SQL = """
SELECT h.host, h.pid
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN asyncwork_lockholder h
    ON h.name = %s AND h.backend_pid = a.pid AND h.backend_start = a.backend_start
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.objsubid = 2
  AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def lock_holder(name: str) -> Holder | None:
    """The process holding the named lock now, or None when no one does."""
    # pg_locks shows the second key as an unsigned oid.
    with connection.cursor() as cursor:
        cursor.execute(HOLDER_SQL, [name, NAMESPACE, lock_key(name) % 2**32])
        row = cursor.fetchone()
    if row is None:
        return None
    host, pid = row
    return Holder(host=host, pid=pid)
