"""Database helpers whose guarantee is a constraint, not a check in Python."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import connection, models


def insert_or_skip(instance: models.Model, *, conflict_fields: Sequence[str]) -> bool:
    """``INSERT ... ON CONFLICT (conflict_fields) DO NOTHING`` for one unsaved instance.

    Returns True and sets ``instance.pk`` when the row was inserted, False when a row with the
    same unique key already existed (or was being inserted by a concurrent transaction, which
    PostgreSQL waits for). Unlike check-then-insert or catching IntegrityError, a concurrent
    duplicate never raises and never logs an error, in the application or in PostgreSQL.
    """
    meta = instance._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key or instance.pk is not None]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    conflict = ", ".join(
        connection.ops.quote_name(meta.get_field(name).column) for name in conflict_fields
    )
    values = [f.get_db_prep_save(f.pre_save(instance, True), connection) for f in fields]
    placeholders = ", ".join(["%s"] * len(fields))
    pk_column = connection.ops.quote_name(meta.pk.column)  # type: ignore[union-attr]
    sql = (
        f"INSERT INTO {connection.ops.quote_name(meta.db_table)} ({columns}) "  # noqa: S608 - identifiers from model metadata
        f"VALUES ({placeholders}) ON CONFLICT ({conflict}) DO NOTHING RETURNING {pk_column}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return False
    instance.pk = row[0]
    instance._state.adding = False
    return True
