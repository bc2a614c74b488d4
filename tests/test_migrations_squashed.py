"""The squashed migrations (each app's ``0001_squashed_...``): a fresh database runs them, not the
files they replace, and ends with the schema those files make; a database migrated through the
replaced files, with rows in every table, is at the squashed migrations with nothing to run and
every row as it was. On databases of the test's own, created and dropped here, migrated by
``manage.py`` as a deployment is. A database partway through the replaced files (from before
the models moved out of core): tests/asyncwork/test_migrations.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from stack.process import ROOT

pytestmark = pytest.mark.slow

APPS = ("core", "operators", "asyncwork", "invoicing", "webhooks")
SQUASHED = {
    ("core", "0001_squashed_0006_models_moved_to_asyncwork_and_operators"),
    ("operators", "0001_squashed_0001_initial"),
    ("asyncwork", "0001_squashed_0005_deadletter_drop_broker_copy"),
    ("invoicing", "0001_squashed_0005_dead_letter_failures_worded"),
    ("webhooks", "0001_squashed_0005_drop_statement_undo"),
}
# Written after the squash, on the last file it replaces: both kinds of database run them.
AFTER = {
    ("asyncwork", "0006_deadletter_resolved"),
    ("asyncwork", "0007_idempotencyrecord_response"),
    ("asyncwork", "0008_job"),
    ("invoicing", "0006_invoice_provider_customer_id"),
    ("invoicing", "0007_email_delivery_recipient_and_bounce"),
    ("invoicing", "0008_email_delivery_provider_message_id"),
    ("invoicing", "0009_email_jobs_named_by_module_path"),
    ("webhooks", "0006_webhookevent_api_version"),
    ("webhooks", "0007_events_reconcile"),
    ("webhooks", "0008_events_cursor_span"),
}

# Migrates the database through the replaced files, as every deployment did before the
# squashed migrations existed (their records then are the replaced files' only), with what
# migrate does after (content types, permissions, the apps' own), and leaves a row in each of
# the apps' tables, made with the models as those files left them.
THROUGH_THE_REPLACED_FILES = """
from datetime import UTC, datetime
from django.core.management.sql import emit_post_migrate_signal
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

executor = MigrationExecutor(connection)
executor.loader = MigrationLoader(connection, replace_migrations=False)
squashed = set(executor.loader.replacements)
ends = [node for node in executor.loader.graph.leaf_nodes() if node not in squashed]
executor.migrate(ends)
for key in squashed:
    MigrationRecorder(connection).record_unapplied(*key)
emit_post_migrate_signal(verbosity=0, interactive=False, db="default")

apps = executor.loader.project_state(ends).apps
now = datetime(2026, 12, 1, tzinfo=UTC)
user = apps.get_model("auth", "User").objects.create(username="operator")
letter_type = apps.get_model("contenttypes", "ContentType").objects.get(
    app_label="asyncwork", model="deadletter"
)
job = apps.get_model("asyncwork", "Job").objects.create(
    task="t", args=[1], queue="default", due_at=now, attempts=1, errors=[{"traceback": "x"}]
)
letter = apps.get_model("asyncwork", "DeadLetter").objects.create(
    task="t", task_id="task-0", queue="default", reason="exhausted", attempts=5,
    first_failed_at=now, last_failed_at=now, replay_job=job,
)
apps.get_model("asyncwork", "ScheduledJob").objects.create(name="job", runs=3)
apps.get_model("asyncwork", "LockHolder").objects.create(
    name="lock", host="h", pid=1, backend_pid=2, backend_start=now, taken_at=now
)
apps.get_model("asyncwork", "WorkerHeartbeat").objects.create(
    owner="w", hostname="h", pid=1, started_at=now, beat_at=now, holding=["x"]
)
apps.get_model("asyncwork", "IdempotencyRecord").objects.create(
    user=user, key="k", fingerprint="f", request="POST /", target_type=letter_type,
    target_id=letter.pk,
)
apps.get_model("operators", "OperatorAction").objects.create(
    action="dead_letter.replay", actor="cli:test", target_type=letter_type,
    target_id=str(letter.pk),
)
invoice = apps.get_model("invoicing", "Invoice").objects.create(
    provider_invoice_id="in_1", status="paid", paid_at=now, provider_updated_at=now,
    recipient_override="someone@example.com",
)
apps.get_model("invoicing", "EmailDelivery").objects.create(
    invoice=invoice, key="invoice-1", state="sent", message_id="<m@x>", sent_at=now
)
apps.get_model("webhooks", "WebhookEvent").objects.create(
    event_id="evt_1", type="invoice.paid", body="{}", state="processed", body_cleared_at=now
)
apps.get_model("webhooks", "EventsCursor").objects.create(
    name="stripe-events-reconcile", covered_until=now, recovered_total=2
)
"""

# What the schema is, without the names PostgreSQL and Django gave its objects: each table's
# columns in order, its constraints and indexes by definition, and the functions.
SCHEMA = {
    "columns": """
        SELECT c.relname, rank() OVER (PARTITION BY c.oid ORDER BY a.attnum), a.attname,
               format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
          AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraints": """
        SELECT conrelid::regclass::text, contype, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace""",
    "indexes": """
        SELECT tablename, regexp_replace(indexdef, '^(CREATE (UNIQUE )?INDEX) \\S+ ON', '\\1 ON')
        FROM pg_indexes WHERE schemaname = 'public'""",
    "functions": """
        SELECT proname || '(' || pg_get_function_identity_arguments(oid) || ')'
        FROM pg_proc WHERE pronamespace = 'public'::regnamespace""",
}
NAMES = """
    SELECT conname FROM pg_constraint WHERE connamespace = 'public'::regnamespace
    UNION ALL SELECT relname FROM pg_class
    WHERE relnamespace = 'public'::regnamespace AND relkind IN ('i', 'S')"""


def _url(name: str) -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{name}"


def _rows(name: str, sql: str) -> list[tuple[Any, ...]]:
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(django_only, None)
    params["dbname"] = name
    with psycopg.connect(**params, autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def _manage(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": _url(name)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _database(suffix: str) -> str:
    """A database of this run's own, created empty (see ``_dropped``)."""
    name = f"{settings.DATABASES['default']['TEST']['NAME']}_{suffix}"
    _rows("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _rows("postgres", f'CREATE DATABASE "{name}"')
    return name


def _dropped(name: str) -> None:
    _rows("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _schema(name: str) -> dict[str, Counter[tuple[Any, ...]]]:
    return {part: Counter(_rows(name, sql)) for part, sql in SCHEMA.items()}


def _tables(name: str) -> list[str]:
    return [
        table
        for (table,) in _rows(name, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        if table.startswith(tuple(f"{app}_" for app in APPS))
    ]


def _contents(name: str) -> dict[str, list[tuple[Any, ...]]]:
    return {table: _rows(name, f'SELECT * FROM "{table}" ORDER BY 1') for table in _tables(name)}


def _recorded(name: str) -> set[tuple[str, str]]:
    return set(_rows(name, "SELECT app, name FROM django_migrations"))


@pytest.fixture(scope="module")
def replaced_files_database() -> Iterator[str]:
    """A database migrated through the replaced files, with a row in every table of the apps."""
    name = _database("replaced")
    try:
        _manage(name, "shell", "--no-imports", "-c", THROUGH_THE_REPLACED_FILES)
        yield name
    finally:
        _dropped(name)


def test_a_fresh_database_runs_the_squashed_migrations_and_gets_the_same_schema(
    replaced_files_database: str,
) -> None:
    name = _database("fresh")
    try:
        out = _manage(name, "migrate", "--noinput")
        applied = {
            (app, migration)
            for app, migration in re.findall(r"Applying (\w+)\.(\w+)\.\.\. OK", out)
            if app in APPS
        }
        assert applied == SQUASHED | AFTER

        assert _schema(name) == _schema(replaced_files_database)
        # The names differ only where the replaced files' database keeps those the moved
        # tables' objects had in core (core_outboxmessage_pkey for asyncwork_outboxmessage's):
        # a fresh database has the names of the app that holds the table.
        fresh = Counter(_rows(name, NAMES))
        replaced = Counter(_rows(replaced_files_database, NAMES))
        only_replaced, only_fresh = replaced - fresh, fresh - replaced
        assert {n for (n,) in only_replaced if not n.startswith("core_")} == set()
        assert {n for (n,) in only_fresh if not n.startswith(("asyncwork_", "operators_"))} == set()
        assert only_replaced.total() == only_fresh.total() > 0
        assert not [t for t in _tables(name) + _tables(replaced_files_database) if "core_" in t]
    finally:
        _dropped(name)


def test_a_database_migrated_through_the_replaced_files_is_at_the_squashed_migrations(
    replaced_files_database: str,
) -> None:
    before = _contents(replaced_files_database)
    assert len(before) == 11
    assert all(before.values())  # a row in every table
    assert not _recorded(replaced_files_database) & SQUASHED

    out = _manage(replaced_files_database, "migrate", "--noinput")

    assert "No migrations to apply." in out
    assert _recorded(replaced_files_database) >= SQUASHED
    assert _contents(replaced_files_database) == before
