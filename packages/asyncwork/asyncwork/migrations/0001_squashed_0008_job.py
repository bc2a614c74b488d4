"""The machinery's tables as they stand, in place of asyncwork's earlier migrations.
Upgrading: CHANGELOG.md, "Upgrading a database migrated before one migration per app"."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("asyncwork", "0001_initial"),
        ("asyncwork", "0001_squashed_0005_deadletter_drop_broker_copy"),
        ("asyncwork", "0002_worker_heartbeat"),
        ("asyncwork", "0003_outbox_due"),
        ("asyncwork", "0004_heartbeat_holding"),
        ("asyncwork", "0005_deadletter_drop_broker_copy"),
        ("asyncwork", "0006_deadletter_resolved"),
        ("asyncwork", "0007_idempotencyrecord_response"),
        ("asyncwork", "0008_job"),
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
            name="Job",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("task", models.CharField(help_text="The task's module path.", max_length=200)),
                (
                    "args",
                    models.JSONField(
                        default=list, help_text="Ids only, never a snapshot of state."
                    ),
                ),
                ("kwargs", models.JSONField(default=dict)),
                ("queue", models.CharField(max_length=100)),
                ("backend", models.CharField(default="default", max_length=100)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("READY", "Ready"),
                            ("RUNNING", "Running"),
                            ("SUCCESSFUL", "Successful"),
                            ("FAILED", "Failed"),
                        ],
                        default="READY",
                        max_length=10,
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                (
                    "due_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="Not published before this time (run_after, a retry's backoff, a deferral's cool-down); empty: at once.",
                        null=True,
                    ),
                ),
                ("published_at", models.DateTimeField(blank=True, null=True)),
                ("publish_attempts", models.PositiveIntegerField(default=0)),
                (
                    "last_error",
                    models.TextField(blank=True, help_text="Why the last publish failed."),
                ),
                ("owner", models.CharField(blank=True, max_length=255)),
                ("lease_expires_at", models.DateTimeField(blank=True, null=True)),
                (
                    "attempts",
                    models.PositiveIntegerField(default=0, help_text="Runs that spent an attempt."),
                ),
                ("worker_ids", models.JSONField(blank=True, default=list)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("last_attempted_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("first_failed_at", models.DateTimeField(blank=True, null=True)),
                ("deferred_since", models.DateTimeField(blank=True, null=True)),
                (
                    "errors",
                    models.JSONField(
                        blank=True,
                        default=list,
                        help_text="Each failed run's exception class and traceback.",
                    ),
                ),
                ("return_value", models.JSONField(blank=True, null=True)),
                ("context", models.JSONField(blank=True, default=dict)),
            ],
            options={
                "permissions": [("republish_job", "Can republish job")],
                "indexes": [
                    models.Index(fields=["task", "args"], name="job_task_args_idx"),
                    models.Index(
                        condition=models.Q(("published_at__isnull", True)),
                        fields=["created_at"],
                        name="job_unpublished_idx",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("due_at__isnull", False), ("published_at__isnull", True)
                        ),
                        fields=["due_at"],
                        name="job_due_idx",
                    ),
                    models.Index(
                        condition=models.Q(("published_at__isnull", False), ("status", "READY")),
                        fields=["published_at"],
                        name="job_ready_idx",
                    ),
                    models.Index(
                        condition=models.Q(("status", "RUNNING")),
                        fields=["lease_expires_at"],
                        name="job_running_idx",
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
                (
                    "response",
                    models.JSONField(
                        blank=True,
                        help_text="The answer given, when the request created no one row.",
                        null=True,
                    ),
                ),
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
                ("resolved_at", models.DateTimeField(blank=True, null=True)),
                ("resolved_by", models.CharField(blank=True, max_length=150)),
                ("resolved_why", models.CharField(blank=True, max_length=500)),
                (
                    "replay_job",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="asyncwork.job",
                    ),
                ),
            ],
            options={
                "permissions": [
                    ("replay_deadletter", "Can replay dead letter"),
                    ("resolve_deadletter", "Can resolve dead letter"),
                ],
                "indexes": [
                    models.Index(
                        condition=models.Q(
                            ("replayed_at__isnull", True), ("resolved_at__isnull", True)
                        ),
                        fields=["created_at"],
                        name="deadletter_waiting_idx",
                    )
                ],
            },
        ),
    ]
