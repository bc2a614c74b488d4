"""Job locks: PostgreSQL session advisory locks, one per job name.

``pg_try_advisory_lock`` never waits: a second run of a job while the first holds the lock
gets False at once and skips. The lock belongs to the database session, so a run whose process
dies releases it when PostgreSQL sees the connection close; no lease to expire, no row to
clean up. Every lock of this application lives in one namespace (the first key), so
``pg_locks`` shows who holds what.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection

logger = logging.getLogger(__name__)

NAMESPACE = 0x1A5C  # the classid of every advisory lock this application takes


def lock_key(name: str) -> int:
    """A stable signed 32-bit key for a lock name."""
    return zlib.crc32(name.encode()) - 2**31


@contextmanager
def advisory_lock(name: str) -> Iterator[bool]:
    """Try to take the named lock on Django's connection; yields whether it was taken.

    The lock is released on exit, or by PostgreSQL when the session ends."""
    key = lock_key(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [NAMESPACE, key])
        (held,) = cursor.fetchone()
    try:
        yield bool(held)
    finally:
        if held:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [NAMESPACE, key])
            except DatabaseError:
                # The session is gone, and the lock with it.
                logger.warning("could not release lock %s: its session is gone", name)


HOLDER_SQL = """
SELECT a.application_name, a.pid, a.client_addr::text
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.objsubid = 2
  AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def lock_holder(name: str) -> str | None:
    """Who holds the named lock now, as ``application_name (pid N)``, or None."""
    # pg_locks shows the second key as an unsigned oid.
    with connection.cursor() as cursor:
        cursor.execute(HOLDER_SQL, [NAMESPACE, lock_key(name) % 2**32])
        row = cursor.fetchone()
    if row is None:
        return None
    application, pid, _ = row
    return f"{application or 'unknown'} (pid {pid})"
