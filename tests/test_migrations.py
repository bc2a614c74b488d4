"""One migration per app: a fresh database applies exactly those four and has nothing left for
``makemigrations``; a database migrated by the previous release (commit ``de09092``), with rows
in every table, has nothing to apply and ends with every row as it was and the schema of a fresh
database; a database partway through that release's migration files is refused
(``asyncwork.E007``) with nothing changed. On databases of the test's own, created and dropped
here, migrated by ``manage.py`` as a deployment is; the previous release's migration files come
from the repository's history (``git archive``), used through ``MIGRATION_MODULES`` in a settings
module of the test's own."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from stack.process import ROOT

pytestmark = pytest.mark.slow

RELEASE = "de09092"
APPS = ("asyncwork", "operators", "invoicing", "webhooks")
MIGRATIONS = {
    ("asyncwork", "0001_squashed_0008_job"),
    ("operators", "0001_squashed_0001_initial"),
    ("invoicing", "0001_squashed_0009_email_jobs_named_by_module_path"),
    ("webhooks", "0001_squashed_0008_events_cursor_span"),
}
# Operators' one migration has the name of the previous release's, which replaced as much.
NEW_NAMES = MIGRATIONS - {("operators", "0001_squashed_0001_initial")}
# Where each app's migrations were in the previous release.
RELEASE_MIGRATIONS = {
    "core": "core/migrations",
    "operators": "operators/migrations",
    "asyncwork": "packages/asyncwork/asyncwork/migrations",
    "invoicing": "invoicing/migrations",
    "webhooks": "webhooks/migrations",
}

# Through the previous release's replaced files only, as a deployment migrated before its
# squashed migrations existed (their records then are the replaced files' only), with what
# migrate does after (content types, permissions, the apps' own); ``targets`` None: to the end.
THROUGH_THE_REPLACED_FILES = """
from django.core.management.sql import emit_post_migrate_signal
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

executor = MigrationExecutor(connection)
executor.loader = MigrationLoader(connection, replace_migrations=False)
squashed = set(executor.loader.replacements)
ends = [node for node in executor.loader.graph.leaf_nodes() if node not in squashed]
executor.migrate(targets or ends)
for key in squashed:
    MigrationRecorder(connection).record_unapplied(*key)
emit_post_migrate_signal(verbosity=0, interactive=False, db="default")
"""

# A row in each of the apps' tables, made with the models as the previous release's files left
# them.
ROWS = """
from datetime import UTC, datetime
from django.db import connection
from django.db.migrations.loader import MigrationLoader

apps = MigrationLoader(connection).project_state().apps
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
    first_failed_at=now, last_failed_at=now, replay_job=job, resolved_why="r",
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
    target_id=letter.pk, response={"count": 1},
)
apps.get_model("operators", "OperatorAction").objects.create(
    action="dead_letter.replay", actor="cli:test", target_type=letter_type,
    target_id=str(letter.pk),
)
invoice = apps.get_model("invoicing", "Invoice").objects.create(
    provider_invoice_id="in_1", status="paid", paid_at=now, provider_updated_at=now,
    recipient_override="someone@example.com", provider_customer_id="cus_1",
)
apps.get_model("invoicing", "EmailDelivery").objects.create(
    invoice=invoice, key="invoice-1", state="sent", message_id="<m@x>", sent_at=now,
    recipient="someone@example.com", provider_message_id="p-1",
)
apps.get_model("webhooks", "WebhookEvent").objects.create(
    event_id="evt_1", type="invoice.paid", body="{}", state="processed", body_cleared_at=now,
    api_version="2026-11-17", source="events_api",
)
apps.get_model("webhooks", "EventsCursor").objects.create(
    name="stripe-events-reconcile", covered_until=now, covered_from=now, recovered_total=2
)
"""

# What the schema is, without the names PostgreSQL and Django gave its objects (a database
# migrated through the replaced files keeps the names its moved tables had in core): each
# table's columns in any order, its constraints and indexes by definition, and the functions.
SCHEMA = {
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
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


def _manage(name: str, *args: str, release: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``manage.py`` on database ``name``: this tree's migrations, or with ``release`` (see
    ``release_settings``) the previous release's."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": _url(name)}
    if release is not None:
        env.update(DJANGO_SETTINGS_MODULE="release_settings", PYTHONPATH=str(release))
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _run(name: str, *args: str, release: Path | None = None) -> str:
    done = _manage(name, *args, release=release)
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
        t for (t,) in _rows(name, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    ]


def _contents(name: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows, but django_migrations' (see ``_recorded``)."""
    return {
        table: _rows(name, f'SELECT * FROM "{table}" ORDER BY 1')
        for table in _tables(name)
        if table != "django_migrations"
    }


def _recorded(name: str) -> Counter[tuple[str, str]]:
    return Counter(_rows(name, "SELECT app, name FROM django_migrations"))


def _applied(out: str) -> set[tuple[str, str]]:
    return {
        (app, migration)
        for app, migration in re.findall(r"Applying (\w+)\.(\w+)\.\.\. OK", out)
        if app in APPS
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's migration files as packages (``release.<app>``), and a settings
    module, ``release_settings``, that is the tests' with those as MIGRATION_MODULES."""
    root = tmp_path_factory.mktemp("release")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", RELEASE, "--", *RELEASE_MIGRATIONS.values()],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root / "tree", filter="data")
    (root / "release").mkdir()
    (root / "release" / "__init__.py").touch()
    for app, path in RELEASE_MIGRATIONS.items():
        (root / "tree" / path).rename(root / "release" / app)
    # A data migration of the release imports the wording of SMTP replies from where it lived then;
    # it lives in asyncwork.contrib.mail now, unchanged.
    worded = root / "release" / "invoicing" / "0005_dead_letter_failures_worded.py"
    worded.write_text(
        worded.read_text().replace(
            "from invoicing.mail import", "from asyncwork.contrib.mail import"
        )
    )
    modules = {app: f"release.{app}" for app in RELEASE_MIGRATIONS}
    (root / "release_settings.py").write_text(
        f"from tests.settings import *  # noqa: F403\n\nMIGRATION_MODULES = {modules!r}\n"
    )
    return root


@pytest.fixture(scope="module")
def fresh() -> Iterator[tuple[str, str]]:
    """A database migrated by this tree from empty, and what ``migrate`` said."""
    name = _database("fresh")
    try:
        yield name, _run(name, "migrate", "--noinput")
    finally:
        _dropped(name)


def test_a_fresh_database_applies_one_migration_per_app_and_has_nothing_left_to_make(
    fresh: tuple[str, str],
) -> None:
    name, out = fresh
    assert _applied(out) == MIGRATIONS
    assert not any(table.startswith("core_") for table in _tables(name))
    made = _manage(name, "makemigrations", "--check", "--dry-run")
    assert (made.returncode, made.stdout.strip()) == (0, "No changes detected"), made.stderr


@pytest.mark.parametrize(
    "through_the_replaced_files",
    [False, True],
    ids=["made-fresh-by-the-release", "through-the-replaced-files"],
)
def test_a_database_the_previous_release_migrated_has_nothing_to_apply_and_keeps_every_row(
    release: Path, fresh: tuple[str, str], through_the_replaced_files: bool
) -> None:
    """The previous release's database, made fresh by its squashed migrations or, older,
    through the files those replace and then migrated by that release."""
    name = _database("release")
    try:
        if through_the_replaced_files:
            script = "targets = None\n" + THROUGH_THE_REPLACED_FILES
            _run(name, "shell", "--no-imports", "-c", script, release=release)
        _run(name, "migrate", "--noinput", release=release)
        _run(name, "shell", "--no-imports", "-c", ROWS, release=release)
        before, recorded = _contents(name), _recorded(name)
        ours = [rows for table, rows in before.items() if table.startswith(APPS)]
        assert len(ours) == 11
        assert all(ours)  # a row in every table of the apps

        out = _run(name, "migrate", "--noinput")

        assert "No migrations to apply." in out
        assert _contents(name) == before
        # The new migrations are recorded as applied, beside every record there was.
        assert _recorded(name) - recorded == Counter(NEW_NAMES)
        assert not recorded - _recorded(name)
        assert _schema(name) == _schema(fresh[0])
    finally:
        _dropped(name)


# (how far the previous release's files took the database, a migration not applied whose file
# is gone, and the migration of this tree that replaces it)
PARTWAY = {
    "asyncwork-at-0007": (
        "migrate asyncwork 0007_idempotencyrecord_response",
        "asyncwork.0008_job",
        "asyncwork.0001_squashed_0008_job",
    ),
    "before-the-move-out-of-core": (
        'targets = [("core", "0005_lockholder")]',
        "operators.0001_initial",
        "operators.0001_squashed_0001_initial",
    ),
    "never-migrated-by-the-previous-release": (
        "targets = None",
        "asyncwork.0001_squashed_0005_deadletter_drop_broker_copy",
        "asyncwork.0001_squashed_0008_job",
    ),
}


@pytest.mark.parametrize("partway", PARTWAY)
def test_a_database_partway_through_the_replaced_files_is_refused_with_nothing_changed(
    release: Path, partway: str
) -> None:
    how, missing, replacement = PARTWAY[partway]
    name = _database("partway")
    try:
        if how.startswith("migrate"):
            _run(name, *how.split(), "--noinput", release=release)
        else:
            script = how + "\n" + THROUGH_THE_REPLACED_FILES
            _run(name, "shell", "--no-imports", "-c", script, release=release)
        before = (_contents(name), _recorded(name), _schema(name))

        done = _manage(name, "migrate", "--noinput")

        assert done.returncode == 1, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert "asyncwork.E007" in done.stderr
        assert f"migrations {replacement} replaces" in done.stderr
        assert missing in done.stderr
        assert f"previous release first (commit {RELEASE}" in done.stderr
        assert done.stdout == ""
        assert (_contents(name), _recorded(name), _schema(name)) == before
        # The same refusal, asked before a deployment: check on the database.
        checked = _manage(name, "check", "--database", "default")
        assert (checked.returncode, "asyncwork.E007" in checked.stderr) == (1, True)
    finally:
        _dropped(name)
