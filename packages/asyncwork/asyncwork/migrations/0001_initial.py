"""The machinery's models, moved here from ``core`` without copying a row: the state is created
here, while the database keeps its tables and renames them (``core_x`` -> ``asyncwork_x``), and
the models' content types are relabelled, so permissions, the groups holding them, admin log
entries and generic foreign keys follow. ``core.0006`` then forgets the old state. A fresh
database runs core's migrations first and arrives at the same tables."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

MODELS = (
    "outboxmessage",
    "deadletter",
    "scheduledjob",
    "idempotencyrecord",
    "lockholder",
)


def _tables(old: str, new: str) -> list[str]:
    return [f"ALTER TABLE {old}_{m} RENAME TO {new}_{m}" for m in MODELS]


def _content_types_move(old: str, new: str):
    """Relabel the models' content types, so the permissions that hang on them (and the
    groups holding those), admin log entries and generic foreign keys follow the models. A
    fresh database has none yet: they are created after migrate, under the new label."""

    def move(apps, schema_editor):
        ContentType = apps.get_model("contenttypes", "ContentType")
        taken = set(
            ContentType.objects.filter(app_label=new, model__in=MODELS).values_list(
                "model", flat=True
            )
        )
        ContentType.objects.filter(app_label=old, model__in=set(MODELS) - taken).update(
            app_label=new
        )

    return move


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        # The tables exist already, made by core's migrations; they move here.
        ("core", "0005_lockholder"),
        ("contenttypes", "0002_remove_content_type_name"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="LockHolder",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
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
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
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
                    name="OutboxMessage",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
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
                    ],
                    options={
                        "permissions": [
                            ("republish_outboxmessage", "Can republish outbox message")
                        ],
                        "indexes": [
                            models.Index(fields=["task", "args"], name="outbox_task_args_idx"),
                            models.Index(
                                condition=models.Q(("published_at__isnull", True)),
                                fields=["created_at"],
                                name="outbox_unpublished_idx",
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
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("key", models.CharField(max_length=255)),
                        (
                            "fingerprint",
                            models.CharField(help_text="SHA-256 of the request.", max_length=64),
                        ),
                        (
                            "request",
                            models.CharField(
                                help_text="Method and path, for people.", max_length=300
                            ),
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
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
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
                            "broker_copy",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to="asyncwork.outboxmessage",
                            ),
                        ),
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
            ],
            database_operations=[
                migrations.RunSQL(
                    sql=_tables("core", "asyncwork"), reverse_sql=_tables("asyncwork", "core")
                ),
                migrations.RunPython(
                    _content_types_move("core", "asyncwork"),
                    _content_types_move("asyncwork", "core"),
                ),
            ],
        ),
    ]
