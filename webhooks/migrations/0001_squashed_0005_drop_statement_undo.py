"""The webhook events' table as it stands. Replaces webhooks 0001-0005 (0004 created a PL/pgSQL
function and 0005 dropped it, so neither is here). A fresh database runs this; a database that
applied 0001-0005 is at it already; one that applied some of them runs the rest from the
replaced files.

The replaced files, and ``replaces`` here, can go once every deployment has applied this
migration (``manage.py showmigrations webhooks``)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("webhooks", "0001_initial"),
        ("webhooks", "0002_webhookevent_body_cleared_at"),
        ("webhooks", "0003_reprocess_power"),
        ("webhooks", "0004_statement_undo"),
        ("webhooks", "0005_drop_statement_undo"),
    ]

    dependencies = []

    operations = [
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
                ("body", models.TextField(help_text="The raw body exactly as received.")),
                ("headers", models.JSONField(default=dict)),
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
                ("body_cleared_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "permissions": [("reprocess_webhookevent", "Can reprocess webhook event")],
            },
        ),
    ]
