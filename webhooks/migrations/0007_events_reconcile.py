"""The reconcile's cursor, and how each event first reached us (existing rows: a webhook)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0006_webhookevent_api_version"),
    ]

    operations = [
        migrations.CreateModel(
            name="EventsCursor",
            fields=[
                ("name", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("covered_until", models.DateTimeField(blank=True, null=True)),
                ("walk_started_at", models.DateTimeField(blank=True, null=True)),
                ("walk_after", models.CharField(blank=True, max_length=255)),
                ("not_before", models.DateTimeField(blank=True, null=True)),
                ("recovered_total", models.PositiveBigIntegerField(default=0)),
                ("last_recovered", models.PositiveIntegerField(default=0)),
                ("last_error", models.TextField(blank=True)),
            ],
        ),
        migrations.AddField(
            model_name="webhookevent",
            name="source",
            field=models.CharField(
                choices=[
                    ("webhook", "Webhook"),
                    ("events_api", "Events API (recovered by the reconcile)"),
                ],
                db_default="webhook",
                default="webhook",
                max_length=10,
            ),
        ),
    ]
