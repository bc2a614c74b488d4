"""Database helpers: an insert whose guarantee is a constraint, not a check in Python, text
that PostgreSQL can always store, a transaction whose statements give up in time (what
every probe of the health check, the metrics and the dashboard runs in), and a worker's
connection kept across tasks as a web process keeps it across requests.

A Celery worker's Django fixup closes every database connection before and after each task
unless ``CELERY_DB_REUSE_MAX`` is set: a new PostgreSQL connection (and backend) per email.
With it set (core/settings.py), each task
is bracketed by Django's own per-request rule instead (``close_old_connections``): a
connection is dropped when it outlived ``CONN_MAX_AGE``, when an error left it unusable, or
when its autocommit was not restored, and ``CONN_HEALTH_CHECKS`` checks it before the task's
first use; after a task that did not succeed, or on a thread of a threads or green pool, it
is closed as Celery closed it."""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from celery.signals import task_postrun, task_prerun
from django.conf import settings
from django.db import (
    close_old_connections,
    connection,
    connections,
    models,
    transaction,
)
from django.db.models import Field
from django.db.models.options import Options

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def text_storable(value: str) -> str:
    """``value`` as PostgreSQL can store it, in a text column or inside JSON: each lone
    surrogate becomes U+FFFD and NUL is dropped. JSON's ``\\ud800`` escape puts a lone
    surrogate in perfectly valid (ASCII) JSON; UTF-8 cannot encode one, so psycopg would raise
    at the INSERT, and PostgreSQL refuses NUL in text and ``\\u0000`` in jsonb."""
    return _LONE_SURROGATE.sub("\ufffd", value).replace("\x00", "")


def _column(field: object) -> str:
    column = getattr(field, "column", None)
    assert isinstance(column, str), field
    return connection.ops.quote_name(column)


@functools.lru_cache(maxsize=64)
def _insert_statement(
    meta: Options[Any], conflict_fields: tuple[str, ...], *, with_pk: bool
) -> tuple[tuple[Field[Any, Any], ...], str]:
    """The fields and the SQL of ``insert_or_skip`` (or of ``insert``, with no conflict fields)
    for one model, worked out once: they run on every webhook delivery, and the ORM's building
    of the statement cost more CPU than sending it."""
    fields = tuple(f for f in meta.concrete_fields if not f.primary_key or with_pk)
    columns = ", ".join(_column(f) for f in fields)
    conflict = ", ".join(_column(meta.get_field(name)) for name in conflict_fields)
    placeholders = ", ".join(["%s"] * len(fields))
    assert meta.pk is not None
    pk_column = _column(meta.pk)
    on_conflict = f"ON CONFLICT ({conflict}) DO NOTHING " if conflict_fields else ""
    sql = (
        f"INSERT INTO {connection.ops.quote_name(meta.db_table)} ({columns}) "  # noqa: S608 - identifiers from model metadata
        f"VALUES ({placeholders}) {on_conflict}RETURNING {pk_column}"
    )
    return fields, sql


def insert_or_skip(instance: models.Model, *, conflict_fields: Sequence[str]) -> bool:
    """``INSERT ... ON CONFLICT (conflict_fields) DO NOTHING`` for one unsaved instance.

    Returns True and sets ``instance.pk`` when the row was inserted, False when a row with the
    same unique key already existed (or was being inserted by a concurrent transaction, which
    PostgreSQL waits for). Unlike check-then-insert or catching IntegrityError, a concurrent
    duplicate never raises and never logs an error, in the application or in PostgreSQL.
    """
    return _insert(instance, tuple(conflict_fields))


def insert(instance: models.Model) -> None:
    """``INSERT`` one unsaved instance and set its ``pk``: what ``save()`` does for a new row
    (``pre_save`` fills ``auto_now_add`` fields), through a statement built once per model."""
    _insert(instance, ())


def _insert(instance: models.Model, conflict_fields: tuple[str, ...]) -> bool:
    meta = instance._meta
    fields, sql = _insert_statement(meta, conflict_fields, with_pk=instance.pk is not None)
    values = [f.get_db_prep_save(f.pre_save(instance, True), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return False
    instance.pk = row[0]
    instance._state.adding = False
    instance._state.db = connection.alias
    return True


def statement_timeout() -> None:
    """Bound every statement of the current transaction by ``PROBE_TIMEOUT_SECONDS``."""
    ms = max(1, int(settings.PROBE_TIMEOUT_SECONDS * 1000))
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(ms)])


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """A transaction whose statements time out after ``PROBE_TIMEOUT_SECONDS``."""
    with transaction.atomic():
        statement_timeout()
        yield


def _connections_tidy(task: Any = None, state: str | None = None, **_: Any) -> None:
    """``task_prerun`` and ``task_postrun``: what Django does at the start and end of each
    request. After a task that did not succeed (failed, retried, deferred, interrupted by its
    soft time limit, perhaps in the middle of a query), or one that ran on a pool's thread,
    its connections are closed outright, as Celery's own rule closes them after every task: a
    query cut short leaves the connection in the middle of a result, no connection to hand to
    the next task. Not for a task applied eagerly: it runs inside its caller's work (a
    test's transaction), whose connection is not the task's to close."""
    if getattr(getattr(task, "request", None), "is_eager", False):
        return
    if state is not None and (state != "SUCCESS" or not _kept_here()):
        connections.close_all()
        return
    close_old_connections()


def _kept_here() -> bool:
    """Whether this task's connections may outlive it: only on a process's main thread (a
    prefork pool process, a solo worker). A thread or green thread of another pool has its own
    connections, which nothing would close once it ends (gevent: one per task)."""
    return threading.current_thread() is threading.main_thread()


def celery_signals_connect() -> None:
    """Connect the receivers above (idempotent: each has a ``dispatch_uid``)."""
    task_prerun.connect(_connections_tidy, weak=False, dispatch_uid="asyncwork.db.start")
    task_postrun.connect(_connections_tidy, weak=False, dispatch_uid="asyncwork.db.end")
