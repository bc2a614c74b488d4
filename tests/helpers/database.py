"""How the tests' database is emptied between transactional tests, and who waits on a lock."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.management import create_permissions
from django.contrib.contenttypes.management import create_contenttypes
from django.core.management.commands import flush
from django.db import connection
from django.db.backends.postgresql.operations import DatabaseOperations
from django.db.models.signals import post_migrate

_truncate = DatabaseOperations.sql_flush
_emit_post_migrate = flush.emit_post_migrate_signal  # type: ignore[attr-defined]
_AUTH = "django.contrib.auth.management.create_permissions"  # auth's dispatch_uid


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
    return [f"DELETE FROM {self.quote_name(table)}" for table in tables if table not in _KEPT]


# What migrate's post_migrate makes of the models alone, the same for every test (no test adds
# or removes a model's content type or permission): kept by the flush.
_KEPT = {"django_content_type", "auth_permission"}


def _post_migrate_but_the_kept(verbosity: int, interactive: bool, db: str) -> None:
    """The post_migrate a flush sends, to every receiver (the schedules' sync among them) but
    the two that would only find the kept rows there, at some 0.1 s a flush."""
    post_migrate.disconnect(create_contenttypes)
    post_migrate.disconnect(dispatch_uid=_AUTH)
    try:
        _emit_post_migrate(verbosity, interactive, db)
    finally:
        post_migrate.connect(create_contenttypes)
        post_migrate.connect(create_permissions, dispatch_uid=_AUTH)


def flush_by_delete() -> None:
    """Between transactional tests Django empties every table (``flush``) with one TRUNCATE,
    about 0.3 s here for tables that hold a few rows; DELETE takes a few milliseconds. The flush
    runs its statements in one transaction, where the deferred foreign keys allow any order.
    The content types and permissions stay (``_KEPT``), under the ids they had, and the
    post_migrate after the flush leaves them be."""
    DatabaseOperations.sql_flush = _sql_flush_by_delete  # type: ignore[method-assign, assignment]
    flush.emit_post_migrate_signal = _post_migrate_but_the_kept  # type: ignore[attr-defined]


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
