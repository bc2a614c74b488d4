"""The machinery's tables as they stand. Replaces asyncwork 0001-0005 and core 0001-0006, which
created these tables in ``core`` before asyncwork 0001 took them over (renamed ``core_x`` ->
``asyncwork_x``). Not their data migrations: the content types' relabelling (0001) and the
deletion of dead letters' unpublished copies (0005) have nothing to act on in a fresh
database.

Django runs a squashed migration only where all or none of what it replaces is applied: a
fresh database runs this one; a database that applied all of them is at it already; a
database partway (core's tables made and not yet moved, or moved and asyncwork not yet at
0005) runs the rest from the replaced files, which keep its rows. Core's migrations are
listed for the database from before the move: it has none of asyncwork's applied, and would
otherwise get empty tables here beside its full ones. All six of them, so that this one
stands for core's history only where core's own squashed migration does.

The replaced files, and ``replaces`` here, can go once every deployment has applied this
migration (``manage.py showmigrations asyncwork``), in the same change as core's and
operators' replaced files."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("core", "0001_initial"),
        ("core", "0002_scheduledjob_outboxmessage_outbox_task_args_idx"),
        ("core", "0003_operator_powers_and_actions"),
        ("core", "0004_idempotencyrecord"),
        ("core", "0005_lockholder"),
        ("core", "0006_models_moved_to_asyncwork_and_operators"),
        ("asyncwork", "0001_initial"),
        ("asyncwork", "0002_worker_heartbeat"),
        ("asyncwork", "0003_outbox_due"),
        ("asyncwork", "0004_heartbeat_holding"),
        ("asyncwork", "0005_deadletter_drop_broker_copy"),
    ]

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="LockHolder",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200, unique=True)),
                ("host", models.CharField(max_length=255)),
                ("pid", models.PositiveIntegerField()),
                ("backend_pid", models.IntegerField()),
                ("backend_start", models.DateTimeField()),
                ("taken_at", models.DateTimeField()),
            ],
        ),
        migrations.CreateModel(
            name="ScheduledJob",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=100, unique=True)),
                ("runs", models.PositiveIntegerField(default=0)),
                ("skips", models.PositiveIntegerField(default=0)),
                ("last_started_at", models.DateTimeField(blank=True, null=True)),
                ("last_finished_at", models.DateTimeField(blank=True, null=True)),
                ("last_skipped_at", models.DateTimeField(blank=True, null=True)),
                ("last_holder", models.CharField(blank=True, max_length=255)),
                ("last_result", models.CharField(blank=True, max_length=500)),
                ("last_error", models.TextField(blank=True)),
            ],
        ),
        migrations.CreateModel(
            name="WorkerHeartbeat",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("owner", models.CharField(max_length=255, unique=True)),
                ("hostname", models.CharField(max_length=255)),
                ("pid", models.PositiveIntegerField()),
                ("started_at", models.DateTimeField()),
                ("beat_at", models.DateTimeField(db_index=True)),
                ("holding", models.JSONField(blank=True, default=list)),
            ],
        ),
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task", models.CharField(max_length=200)),
                (
                    "args",
                    models.JSONField(
                        default=list, help_text="Ids only, never a snapshot of state."
                    ),
                ),
                ("kwargs", models.JSONField(default=dict)),
                ("queue", models.CharField(max_length=100)),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("published_at", models.DateTimeField(blank=True, null=True)),
                ("publish_attempts", models.PositiveIntegerField(default=0)),
                ("last_error", models.TextField(blank=True)),
                (
                    "due_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="Not published before this time (a retry's backoff, a deferral's cool-down); empty: at once.",
                        null=True,
                    ),
                ),
                (
                    "headers",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="Message headers a retry carries on (its retry count, when it first failed).",
                    ),
                ),
                (
                    "task_id",
                    models.CharField(
                        blank=True,
                        help_text="The Celery task id a retry keeps; empty: outbox-<id>.",
                        max_length=255,
                    ),
                ),
            ],
            options={
                "permissions": [("republish_outboxmessage", "Can republish outbox message")],
                "indexes": [
                    models.Index(fields=["task", "args"], name="outbox_task_args_idx"),
                    models.Index(
                        condition=models.Q(("published_at__isnull", True)),
                        fields=["created_at"],
                        name="outbox_unpublished_idx",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("due_at__isnull", False), ("published_at__isnull", True)
                        ),
                        fields=["due_at"],
                        name="outbox_due_idx",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="IdempotencyRecord",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("key", models.CharField(max_length=255)),
                (
                    "fingerprint",
                    models.CharField(help_text="SHA-256 of the request.", max_length=64),
                ),
                (
                    "request",
                    models.CharField(help_text="Method and path, for people.", max_length=300),
                ),
                ("target_id", models.PositiveBigIntegerField(blank=True, null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "target_type",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="contenttypes.contenttype",
                    ),
                ),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("user", "key"), name="idempotency_user_key_uniq"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="DeadLetter",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task", models.CharField(max_length=200)),
                ("task_id", models.CharField(max_length=255, unique=True)),
                ("args", models.JSONField(default=list)),
                ("kwargs", models.JSONField(default=dict)),
                ("queue", models.CharField(max_length=100)),
                (
                    "reason",
                    models.CharField(
                        choices=[
                            ("permanent", "Permanent failure"),
                            ("exhausted", "Retries exhausted"),
                            ("provider_unavailable", "Provider unavailable"),
                            ("redelivery_limit", "Redelivered too often"),
                        ],
                        max_length=32,
                    ),
                ),
                ("exception_class", models.CharField(blank=True, max_length=255)),
                ("exception_message", models.TextField(blank=True)),
                ("traceback", models.TextField(blank=True)),
                ("attempts", models.PositiveIntegerField()),
                ("first_failed_at", models.DateTimeField()),
                ("last_failed_at", models.DateTimeField()),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("replayed_at", models.DateTimeField(blank=True, null=True)),
                ("replayed_by", models.CharField(blank=True, max_length=150)),
                (
                    "replay_outbox",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="asyncwork.outboxmessage",
                    ),
                ),
            ],
            options={
                "permissions": [("replay_deadletter", "Can replay dead letter")],
                "indexes": [
                    models.Index(
                        condition=models.Q(("replayed_at__isnull", True)),
                        fields=["created_at"],
                        name="deadletter_waiting_idx",
                    )
                ],
            },
        ),
    ]
