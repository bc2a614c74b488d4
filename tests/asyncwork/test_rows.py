"""``asyncwork.db``'s row reads, against this run's PostgreSQL: a row read by ``row_get`` is
the instance the ORM loads, field for field (JSON and times converted the ORM's way)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from asyncwork.db import row_get
from asyncwork.models import OutboxMessage

pytestmark = pytest.mark.django_db(transaction=True)


def _fields(row: OutboxMessage) -> dict[str, object]:
    return {f.attname: getattr(row, f.attname) for f in OutboxMessage._meta.concrete_fields}


def test_row_get_loads_a_row_as_the_orm_does_and_none_for_no_row() -> None:
    stored = OutboxMessage.objects.create(
        task="core.nothing",
        args=[7, "ü"],
        kwargs={"nested": {"list": [1, None, True]}},
        queue="default",
        published_at=timezone.now() - timedelta(minutes=3),
        headers={"h": "v"},
    )

    read = row_get(OutboxMessage, stored.pk)

    assert read is not None
    assert _fields(read) == _fields(OutboxMessage.objects.get(pk=stored.pk))
    assert (read._state.adding, read._state.db) == (False, "default")
    assert row_get(OutboxMessage, stored.pk + 1000) is None


def test_row_get_is_one_statement_per_read() -> None:
    rows = OutboxMessage.objects.bulk_create(
        OutboxMessage(task="core.nothing", args=[n], queue="default") for n in range(3)
    )
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as queries:
        read = [row_get(OutboxMessage, row.pk) for row in rows]

    assert [row.args for row in read if row is not None] == [[0], [1], [2]]
    assert len(queries) == 3
