from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built without blocking the writes of a live table (CREATE INDEX CONCURRENTLY, which
    # cannot run in a transaction).
    atomic = False

    dependencies = [
        ("invoicing", "0003_recipient_override_and_powers"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="emaildelivery",
            index=models.Index(
                condition=models.Q(("state", "sending")),
                fields=["updated_at"],
                name="emaildelivery_sending_idx",
            ),
        ),
    ]
