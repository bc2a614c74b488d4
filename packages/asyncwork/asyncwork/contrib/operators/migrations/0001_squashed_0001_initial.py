"""The audit trail's table as it stands, in place of operators' earlier migrations and core's.
Upgrading: CHANGELOG.md, "Upgrading a database migrated before one migration per app"."""

import django.db.models.deletion
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
        ("operators", "0001_initial"),
    ]

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.CreateModel(
            name="OperatorAction",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("action", models.CharField(db_index=True, max_length=100)),
                ("actor", models.CharField(db_index=True, max_length=150)),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("target_id", models.CharField(blank=True, max_length=64)),
                ("target_label", models.CharField(blank=True, max_length=255)),
                ("before", models.JSONField(blank=True, null=True)),
                ("after", models.JSONField(blank=True, null=True)),
                ("detail", models.CharField(blank=True, max_length=500)),
                (
                    "target_type",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="contenttypes.contenttype",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(
                        fields=["target_type", "target_id"], name="operatoraction_target_idx"
                    )
                ],
            },
        ),
    ]
