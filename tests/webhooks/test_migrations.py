"""``webhooks_statement_undo`` goes with migration 0005: a deployed database that has it (0004
applied, events stored) migrates forward without it and keeps every event; migrated back, it
has the function again. Against this run's PostgreSQL, migrated as Django's own migration
tests do."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError, connection
from django.db.migrations.executor import MigrationExecutor

from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)

WITH_FUNCTION = ("webhooks", "0004_statement_undo")


def _migrate(target: tuple[str, str] | None = None) -> None:
    """To ``target``, by default the latest migration (0005 and those after it)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([target] if target else executor.loader.graph.leaf_nodes("webhooks"))


def _undo_function_exists() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regprocedure('webhooks_statement_undo(text)') IS NOT NULL")
        row = cursor.fetchone()
    assert row is not None
    return bool(row[0])


def test_0005_drops_the_undo_function_keeps_every_event_and_reverses() -> None:
    try:
        _migrate(WITH_FUNCTION)
        assert _undo_function_exists()
        old: Any = MigrationExecutor(connection).loader.project_state([WITH_FUNCTION]).apps
        stored = old.get_model("webhooks", "WebhookEvent").objects.create(
            event_id="evt_migrated", type="invoice.paid", body="{}", state="processed"
        )

        _migrate()
        assert not _undo_function_exists()
        assert WebhookEvent.objects.get(event_id="evt_migrated").pk == stored.pk

        _migrate(WITH_FUNCTION)
        assert _undo_function_exists()
        with connection.cursor() as cursor, pytest.raises(OperationalError, match="reason given"):
            cursor.execute("SELECT webhooks_statement_undo('reason given')")
    finally:
        _migrate()
    assert not _undo_function_exists()
