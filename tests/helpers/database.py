"""How the tests' database is emptied between transactional tests, and who waits on a lock."""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.db.backends.postgresql.operations import DatabaseOperations

_truncate = DatabaseOperations.sql_flush


def _sql_flush_by_delete(
    self: DatabaseOperations,
    style: Any,
    tables: list[str],
    *,
    reset_sequences: bool = False,
    allow_cascade: bool = False,
) -> list[str]:
    if reset_sequences or allow_cascade:
        return _truncate(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
    return [f"DELETE FROM {self.quote_name(table)}" for table in tables]


def flush_by_delete() -> None:
    """Between transactional tests Django empties every table (``flush``) with one TRUNCATE,
    about 0.3 s here for tables that hold a few rows; DELETE takes a few milliseconds. The flush
    runs its statements in one transaction, where the deferred foreign keys allow any order."""
    DatabaseOperations.sql_flush = _sql_flush_by_delete  # type: ignore[method-assign, assignment]


def lock_waiters() -> int:
    """Sessions of this test database waiting for a lock: how a test knows its threads are
    queued behind the lock it holds."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = cursor.fetchone()
    return int(row[0]) if row else 0
