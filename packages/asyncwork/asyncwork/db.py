"""Database helpers: an insert built once per model (guarded by a constraint or not), text
PostgreSQL can always store, a transaction whose statements give up in time (``bounded``, where
every probe and every bulk dead-letter request runs), and a worker's connections kept across
tasks.

With ``CELERY_DB_REUSE_MAX`` set (core/settings.py) Celery's Django fixup keeps connections, and
each task is bracketed by Django's per-request rule (``close_old_connections``: ``CONN_MAX_AGE``,
unusable after an error, autocommit not restored; ``CONN_HEALTH_CHECKS``). After a task that did
not succeed (perhaps cut off mid-query), or on a pool's thread (which would leave them open), its
connections are closed outright.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from celery.signals import task_postrun, task_prerun
from django.db import (
    OperationalError,
    close_old_connections,
    connection,
    connections,
    models,
    transaction,
)
from django.db.models import Field
from django.db.models.options import Options
from psycopg.errors import QueryCanceled

from asyncwork.settings import asyncwork_settings

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def text_storable(value: str) -> str:
    """``value`` as PostgreSQL can store it in text or JSON: lone surrogates (valid as JSON's
    ``\ud800``, not in UTF-8) become U+FFFD and NUL is dropped."""
    return _LONE_SURROGATE.sub("\ufffd", value).replace("\x00", "")


def _column(field: object) -> str:
    column = getattr(field, "column", None)
    assert isinstance(column, str), field
    return connection.ops.quote_name(column)


@functools.lru_cache(maxsize=64)
def _insert_statement(
    meta: Options[Any], conflict_fields: tuple[str, ...], *, with_pk: bool
) -> tuple[tuple[Field[Any, Any], ...], str]:
    """The fields and SQL of an insert of a model (with ``ON CONFLICT`` if ``conflict_fields``),
    built once: every webhook and every enqueue runs them."""
    fields = tuple(f for f in meta.concrete_fields if not f.primary_key or with_pk)
    columns = ", ".join(_column(f) for f in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    conflict = ", ".join(_column(meta.get_field(name)) for name in conflict_fields)
    assert meta.pk is not None
    sql = (
        f"INSERT INTO {connection.ops.quote_name(meta.db_table)} ({columns}) "  # noqa: S608 - identifiers from model metadata
        f"VALUES ({placeholders})"
        + (f" ON CONFLICT ({conflict}) DO NOTHING" if conflict_fields else "")
        + f" RETURNING {_column(meta.pk)}"
    )
    return fields, sql


def insert(instance: models.Model) -> None:
    """``INSERT`` of one unsaved instance (``Model.save()`` without the SQL compiled on every call
    nor the signals), ``instance.pk`` set: what every enqueue runs."""
    _insert(instance, conflict_fields=())


def insert_or_skip(instance: models.Model, *, conflict_fields: Sequence[str]) -> bool:
    """``INSERT ... ON CONFLICT (conflict_fields) DO NOTHING`` of one unsaved instance: True (and
    ``instance.pk`` set) when inserted, False when the key existed or a concurrent transaction was
    inserting it. A duplicate never raises nor logs an error, here or in PostgreSQL."""
    return _insert(instance, conflict_fields=conflict_fields)


def _insert(instance: models.Model, *, conflict_fields: Sequence[str]) -> bool:
    meta = instance._meta
    fields, sql = _insert_statement(meta, tuple(conflict_fields), with_pk=instance.pk is not None)
    with connection.cursor() as cursor:
        # The connection itself (cursor.db), as Django's compiler gives it: through the
        # ``connection`` proxy each field's preparation would look it up again, several times.
        values = [f.get_db_prep_save(f.pre_save(instance, True), cursor.db) for f in fields]
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return False
    instance.pk = row[0]
    instance._state.adding = False
    instance._state.db = connection.alias
    return True


@contextlib.contextmanager
def bounded(seconds: float | None = None) -> Iterator[None]:
    """A transaction whose statements time out after ``seconds`` (``PROBE_TIMEOUT_SECONDS``
    unless given): PostgreSQL's ``SET LOCAL statement_timeout``, which a lock wait counts
    toward too. A statement cancelled so raises an ``OperationalError`` that
    ``statement_timed_out`` recognises."""
    if seconds is None:
        seconds = asyncwork_settings.PROBE_TIMEOUT_SECONDS
    ms = max(1, int(seconds * 1000))
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(ms)])
        yield


def statement_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL cancelling a statement (at its ``statement_timeout``)."""
    return isinstance(exc, OperationalError) and isinstance(exc.__cause__, QueryCanceled)


def _connections_tidy(task: Any = None, state: str | None = None, **_: Any) -> None:
    """``task_prerun``/``task_postrun``; not for an eager task, whose connection is its caller's."""
    if getattr(getattr(task, "request", None), "is_eager", False):
        return
    main_thread = threading.current_thread() is threading.main_thread()
    if state is not None and (state != "SUCCESS" or not main_thread):
        connections.close_all()
        return
    close_old_connections()


def celery_signals_connect() -> None:
    """Connect the receivers above (idempotent: each has a ``dispatch_uid``)."""
    task_prerun.connect(_connections_tidy, weak=False, dispatch_uid="asyncwork.db.start")
    task_postrun.connect(_connections_tidy, weak=False, dispatch_uid="asyncwork.db.end")
