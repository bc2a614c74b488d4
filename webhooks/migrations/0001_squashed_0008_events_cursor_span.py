"""The webhook events' tables as they stand, in place of webhooks' earlier migrations.
Upgrading: CHANGELOG.md, "Upgrading a database migrated before one migration per app"."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("webhooks", "0001_initial"),
        ("webhooks", "0001_squashed_0005_drop_statement_undo"),
        ("webhooks", "0002_webhookevent_body_cleared_at"),
        ("webhooks", "0003_reprocess_power"),
        ("webhooks", "0004_statement_undo"),
        ("webhooks", "0005_drop_statement_undo"),
        ("webhooks", "0006_webhookevent_api_version"),
        ("webhooks", "0007_events_reconcile"),
        ("webhooks", "0008_events_cursor_span"),
    ]

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="EventsCursor",
            fields=[
                ("name", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("covered_from", models.DateTimeField(blank=True, null=True)),
                ("covered_until", models.DateTimeField(blank=True, null=True)),
                ("walk_since", models.DateTimeField(blank=True, null=True)),
                ("walk_started_at", models.DateTimeField(blank=True, null=True)),
                ("walk_after", models.CharField(blank=True, max_length=255)),
                ("not_before", models.DateTimeField(blank=True, null=True)),
                ("recovered_total", models.PositiveBigIntegerField(default=0)),
                ("last_recovered", models.PositiveIntegerField(default=0)),
                ("last_error", models.TextField(blank=True)),
            ],
        ),
        migrations.CreateModel(
            name="WebhookEvent",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("event_id", models.CharField(max_length=255, unique=True)),
                ("type", models.CharField(db_index=True, max_length=255)),
                ("livemode", models.BooleanField(default=False)),
                ("api_version", models.CharField(blank=True, default="", max_length=64)),
                ("body", models.TextField(help_text="The raw body exactly as received.")),
                ("headers", models.JSONField(default=dict)),
                ("body_cleared_at", models.DateTimeField(blank=True, null=True)),
                ("received_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("processed", "Processed"),
                            ("ignored", "Ignored (type not acted on)"),
                            ("failed", "Failed"),
                        ],
                        max_length=10,
                    ),
                ),
                ("error", models.TextField(blank=True)),
                (
                    "source",
                    models.CharField(
                        choices=[
                            ("webhook", "Webhook"),
                            ("events_api", "Events API (recovered by the reconcile)"),
                        ],
                        db_default="webhook",
                        default="webhook",
                        max_length=10,
                    ),
                ),
            ],
            options={
                "permissions": [("reprocess_webhookevent", "Can reprocess webhook event")],
                "indexes": [
                    models.Index(fields=["api_version", "received_at"], name="webhook_version_idx")
                ],
            },
        ),
    ]
