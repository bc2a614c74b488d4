"""The machinery's models moved out of ``core`` (into ``asyncwork`` and ``operators``) by state,
not by copying: an existing database keeps every row, every content type with the permissions
hanging on it, and every group holding one. Migrated here from the state before the move, as
Django's own migration tests do, with rows in each moved table: through the replaced files, as
such a database still migrates now that squashed migrations replace them.

A dead letter's copy for the ``dlq`` queue goes (asyncwork 0005): the column, and the outbox
rows of copies not yet published; every dead letter, and every other outbox row, stays."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from django.utils import timezone

from asyncwork.models import DeadLetter, IdempotencyRecord, LockHolder, OutboxMessage, ScheduledJob
from operators.models import OperatorAction

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE: list[tuple[str, str | None]] = [
    ("core", "0005_lockholder"),
    ("asyncwork", None),
    ("operators", None),
]


def _migrate(targets: list[tuple[str, str | None]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    ContentType.objects.clear_cache()


def _squashed_records_forget() -> None:
    """The test database was made by the squashed migrations, which record themselves beside
    what they replace; a database from before them holds only the replaced files' records. Left
    in, Django's rollback to a replaced migration (``core 0005``, through the replaced files)
    would undo the squashed ones too, dropping the tables."""
    recorder = MigrationRecorder(connection)
    for app_label, name in MigrationLoader(None).replacements:
        recorder.record_unapplied(app_label, name)


def test_an_existing_database_keeps_its_rows_permissions_and_groups() -> None:
    _squashed_records_forget()
    _migrate(BEFORE)
    old: Any = (
        MigrationExecutor(connection).loader.project_state([("core", "0005_lockholder")]).apps
    )
    now = timezone.now()
    ContentTypes = old.get_model("contenttypes", "ContentType")
    Permissions = old.get_model("auth", "Permission")
    Groups = old.get_model("auth", "Group")
    Users = old.get_model("auth", "User")
    letter_type, _ = ContentTypes.objects.get_or_create(app_label="core", model="deadletter")
    replay, _ = Permissions.objects.get_or_create(
        content_type=letter_type, codename="replay_deadletter", defaults={"name": "Can replay"}
    )
    group = Groups.objects.create(name="migration-operators")
    group.permissions.add(replay)
    user = Users.objects.create(username="migration-operator")
    user.groups.add(group)

    Outbox = old.get_model("core", "OutboxMessage")
    outbox = Outbox.objects.create(task="some.task", args=[1], queue="dlq", published_at=now)
    unsent_copy = Outbox.objects.create(task="some.task", args=[2], queue="dlq")
    pending = Outbox.objects.create(task="some.task", args=[3], queue="default")
    letter, unsent = (
        old.get_model("core", "DeadLetter").objects.create(
            task="some.task",
            task_id=f"migration-{n}",
            args=[n],
            queue="default",
            reason="permanent",
            exception_message=f"failure {n}",
            attempts=1,
            first_failed_at=now,
            last_failed_at=now,
            broker_copy=copy,
        )
        for n, copy in ((1, outbox), (2, unsent_copy))
    )
    old.get_model("core", "ScheduledJob").objects.create(name="migration-job", runs=3)
    old.get_model("core", "LockHolder").objects.create(
        name="migration-lock", host="h", pid=1, backend_pid=2, backend_start=now, taken_at=now
    )
    old.get_model("core", "IdempotencyRecord").objects.create(
        user=user,
        key="k-1",
        fingerprint="f",
        request="POST /",
        target_type=letter_type,
        target_id=letter.pk,
    )
    old.get_model("core", "OperatorAction").objects.create(
        action="dead_letter.replay",
        actor="cli:test",
        target_type=letter_type,
        target_id=str(letter.pk),
    )

    executor = MigrationExecutor(connection)
    _migrate(list(executor.loader.graph.leaf_nodes()))

    moved = DeadLetter.objects.get(task_id="migration-1")
    assert moved.pk == letter.pk
    assert [(x.pk, x.args, x.exception_message) for x in DeadLetter.objects.order_by("pk")] == [
        (letter.pk, [1], "failure 1"),
        (unsent.pk, [2], "failure 2"),
    ]
    # The copy not yet published is gone, the published one and the job waiting stay.
    assert sorted(OutboxMessage.objects.values_list("pk", flat=True)) == [outbox.pk, pending.pk]
    with connection.cursor() as cursor:
        columns = [
            c.name
            for c in connection.introspection.get_table_description(
                cursor, DeadLetter._meta.db_table
            )
        ]
    assert "broker_copy_id" not in columns
    assert "replay_outbox_id" in columns
    assert ScheduledJob.objects.get(name="migration-job").runs == 3
    assert LockHolder.objects.filter(name="migration-lock").exists()
    # The content type moved with its model: no second one, and what named it still does.
    assert not ContentType.objects.filter(app_label="core").exists()
    assert ContentType.objects.get_for_model(DeadLetter).pk == letter_type.pk
    assert OperatorAction.objects.get(actor="cli:test").target == moved
    assert IdempotencyRecord.objects.get(key="k-1").target == moved
    # The group still holds the permission, now under the new label, and so its member.
    assert Permission.objects.get(pk=replay.pk).content_type.app_label == "asyncwork"
    assert list(Group.objects.get(name="migration-operators").permissions.all()) == [
        Permission.objects.get(codename="replay_deadletter")
    ]
    assert User.objects.get(username="migration-operator").has_perm("asyncwork.replay_deadletter")
    # And the tables are the new apps': a new row goes where the old ones are.
    assert OutboxMessage.objects.create(task="t", queue="default").pk > outbox.pk
    assert now - timedelta(minutes=5) < moved.created_at
