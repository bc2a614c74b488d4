"""Each event's Stripe API version (existing rows: ""), indexed with the time it was received."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # The index is built without blocking the writes of a live table (CREATE INDEX
    # CONCURRENTLY, which cannot run in a transaction). Adding a column with a constant default
    # rewrites nothing.
    atomic = False

    dependencies = [
        ("webhooks", "0005_drop_statement_undo"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhookevent",
            name="api_version",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        AddIndexConcurrently(
            model_name="webhookevent",
            index=models.Index(fields=["api_version", "received_at"], name="webhook_version_idx"),
        ),
    ]
