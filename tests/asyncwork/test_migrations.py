"""The machinery's models moved out of ``core`` (into ``asyncwork`` and ``operators``) by state,
not by copying: an existing database keeps every row, every content type with the permissions
hanging on it, and every group holding one. Migrated here from the state before the move, as
Django's own migration tests do, with rows in each moved table: through the replaced files, as
such a database still migrates now that squashed migrations replace them.

A dead letter's copy for the ``dlq`` queue goes (asyncwork 0005): the column, and the outbox
rows of copies not yet published; every dead letter, and every other outbox row, stays.

The outbox row becomes the job (asyncwork 0008): every row is carried forward under its id, a
row published before as SUCCESSFUL (its outcome was never on the row), the rest READY with their
due time; a dead letter's replay names the same row, and heartbeats forget what they held (a list
of messages before, of job ids now)."""

from __future__ import annotations

from collections.abc import Sequence
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

from asyncwork.models import (
    DeadLetter,
    IdempotencyRecord,
    Job,
    LockHolder,
    ScheduledJob,
    WorkerHeartbeat,
)
from operators.models import OperatorAction

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE: list[tuple[str, str | None]] = [
    ("core", "0005_lockholder"),
    ("asyncwork", None),
    ("operators", None),
]


def _migrate(targets: Sequence[tuple[str, str | None]]) -> None:
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
    assert sorted(Job.objects.values_list("pk", flat=True)) == [outbox.pk, pending.pk]
    with connection.cursor() as cursor:
        columns = [
            c.name
            for c in connection.introspection.get_table_description(
                cursor, DeadLetter._meta.db_table
            )
        ]
    assert "broker_copy_id" not in columns
    assert "replay_job_id" in columns
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
    assert Job.objects.create(task="t", queue="default").pk > outbox.pk
    assert now - timedelta(minutes=5) < moved.created_at


BEFORE_JOBS = [("asyncwork", "0007_idempotencyrecord_response")]


def test_every_outbox_row_is_carried_forward_as_a_job() -> None:
    _migrate(BEFORE_JOBS)
    old: Any = MigrationExecutor(connection).loader.project_state(BEFORE_JOBS).apps
    now = timezone.now()
    Outbox = old.get_model("asyncwork", "OutboxMessage")
    published = Outbox.objects.create(
        task="some.task",
        args=[1],
        queue="email",
        published_at=now - timedelta(hours=1),
        publish_attempts=1,
    )
    unpublished = Outbox.objects.create(
        task="some.task",
        args=[2],
        queue="email",
        publish_attempts=2,
        last_error="ConnectionRefusedError(111)",
    )
    retry = Outbox.objects.create(
        task="some.task",
        args=[3],
        kwargs={"key": "k"},
        queue="default",
        due_at=now + timedelta(minutes=5),
        task_id=f"outbox-{published.pk}",
        headers={"retries": 2, "first_failed_at": now.isoformat()},
    )
    old.get_model("asyncwork", "DeadLetter").objects.create(
        task="some.task",
        task_id="migration-replayed",
        args=[1],
        queue="email",
        reason="permanent",
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
        replayed_at=now,
        replay_outbox=published,
    )
    old.get_model("asyncwork", "WorkerHeartbeat").objects.create(
        owner="gone-host:7:beef",
        hostname="gone-host",
        pid=7,
        started_at=now,
        beat_at=now,
        holding=[{"task": "some.task", "id": "outbox-9", "args": [9], "retries": 0}],
    )
    rows = {row.pk: row for row in Outbox.objects.all()}

    _migrate(list(MigrationExecutor(connection).loader.graph.leaf_nodes()))

    jobs = {job.pk: job for job in Job.objects.all()}
    assert set(jobs) == set(rows)
    for pk, job in jobs.items():
        row = rows[pk]
        assert (job.task, job.args, job.kwargs, job.queue, job.created_at) == (
            row.task,
            row.args,
            row.kwargs,
            row.queue,
            row.created_at,
        )
        assert (job.published_at, job.publish_attempts, job.last_error, job.due_at) == (
            row.published_at,
            row.publish_attempts,
            row.last_error,
            row.due_at,
        )
        # Nothing ran on the row: no attempt, owner, lease nor error.
        assert (job.attempts, job.owner, job.lease_expires_at, job.errors) == (0, "", None, [])
        assert (job.backend, job.started_at, job.return_value) == ("default", None, None)
    done = jobs[published.pk]
    assert (done.status, done.finished_at) == (Job.Status.SUCCESSFUL, published.published_at)
    assert (jobs[unpublished.pk].status, jobs[unpublished.pk].finished_at) == ("READY", None)
    assert (jobs[retry.pk].status, jobs[retry.pk].finished_at) == ("READY", None)
    # The relay takes the unpublished row now, the retry once due, never the one published.
    later = timezone.now()
    assert list(Job.objects.waiting(later)) == [jobs[unpublished.pk]]
    assert list(Job.objects.scheduled(later)) == [jobs[retry.pk]]
    assert list(Job.objects.waiting(later + timedelta(minutes=6)).order_by("pk")) == [
        jobs[unpublished.pk],
        jobs[retry.pk],
    ]
    assert DeadLetter.objects.get(task_id="migration-replayed").replay_job_id == published.pk
    assert WorkerHeartbeat.objects.get(owner="gone-host:7:beef").holding == []
    assert Job.objects.create(task="t", queue="default").pk > max(jobs)
