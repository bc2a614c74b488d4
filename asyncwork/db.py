"""Database helpers: an insert whose guarantee is a constraint, not a check in Python, text
that PostgreSQL can always store, a transaction whose statements give up in time (what
every probe of the health check, the metrics and the dashboard runs in), and a worker's
connection kept across tasks as a web process keeps it across requests.

A Celery worker's Django fixup closes every database connection before and after each task
unless ``CELERY_DB_REUSE_MAX`` is set: a new PostgreSQL connection (and backend) per email,
which cost more CPU than the email's own statements. With it set (core/settings.py), each task
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
from typing import Any, TypeVar

import psycopg
from celery.signals import task_postrun, task_prerun
from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    close_old_connections,
    connection,
    connections,
    models,
    transaction,
)
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import Field
from django.db.models.options import Options

M = TypeVar("M", bound=models.Model)

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


@functools.lru_cache(maxsize=64)
def _select_statement(meta: Options[Any]) -> tuple[list[str], list[tuple[int, Any]], str]:
    """The attribute names, the value converters (by position) and the columns selected by
    ``row_get`` for one model, worked out once."""
    fields = meta.concrete_fields
    converters = [
        (i, converter)
        for i, f in enumerate(fields)
        for converter in f.get_db_converters(connection)
    ]
    return [f.attname for f in fields], converters, ", ".join(_column(f) for f in fields)


def row_columns(model: type[models.Model]) -> str:
    """The columns of ``model``'s row, in the order ``row_load`` reads them: for a statement
    that returns the row with something else (``SELECT <these>, ...``)."""
    return _select_statement(model._meta)[2]


def row_load(model: type[M], values: Sequence[Any]) -> M:
    """The instance of ``model`` whose row is ``values`` (``row_columns``' order), as the ORM
    loads it."""
    names, converters, _ = _select_statement(model._meta)
    loaded = list(values)
    for i, converter in converters:
        loaded[i] = converter(loaded[i], None, connection)
    return model.from_db(connection.alias, names, loaded)


@functools.lru_cache(maxsize=64)
def _row_get_sql(meta: Options[Any]) -> str:
    assert meta.pk is not None
    return (
        f"SELECT {_select_statement(meta)[2]} "  # noqa: S608 - identifiers from model metadata
        f"FROM {connection.ops.quote_name(meta.db_table)} WHERE {_column(meta.pk)} = %s"
    )


def row_get(model: type[M], pk: Any) -> M | None:
    """The row of ``model`` with primary key ``pk``, or None: ``filter(pk=pk).first()``
    through a statement built once per model, prepared once per connection in autocommit
    (it runs for every email a worker sends)."""
    with statement_cursor() as cursor:
        cursor.execute(_row_get_sql(model._meta), [pk])
        row = cursor.fetchone()
    return None if row is None else row_load(model, row)


class _PreparingCursor(psycopg.Cursor[Any]):
    """A cursor binding parameters on the server, each statement prepared on its first run on
    the connection (``core.postgresql`` lets psycopg prepare what is asked for)."""

    def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
        return super().execute(query, params, **{**options, "prepare": True})


@contextlib.contextmanager
def prepared_cursor() -> Iterator[CursorWrapper]:
    """A Django cursor (its error wrapping, its execute wrappers, its query log) on the
    default connection whose statements are prepared once per connection and then run by
    name, their parameters bound on the server. For a long statement run on every request:
    sent as text with its values inlined, as Django's own cursors send it, PostgreSQL spent
    more CPU parsing and planning it than running it (``webhooks.services``). Outside a
    transaction block (autocommit), where the callers need it."""
    # The connection itself, looked up once: each attribute read through the ``connection``
    # proxy looks it up again in asgiref's ``Local`` (about 3 us a read).
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    assert not db.in_atomic_block
    raw = db.connection
    assert raw is not None
    with db.wrap_database_errors, _PreparingCursor(raw) as cursor:
        wrapper = CursorDebugWrapper if db.queries_logged else CursorWrapper
        yield wrapper(cursor, db)


def statement_cursor() -> contextlib.AbstractContextManager[CursorWrapper]:
    """For a statement run on every task or request: ``prepared_cursor`` in autocommit, where
    it can be used; Django's own cursor inside a transaction block (a caller's, or a test's)."""
    db = connections[DEFAULT_DB_ALIAS]
    return db.cursor() if db.in_atomic_block else prepared_cursor()


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
    its connections are closed outright, as Celery closed them after every task: a query cut
    short leaves the connection busy, which the socket check before the next task's first
    query cannot see. Not for a task applied eagerly: it runs inside its caller's work (a
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
