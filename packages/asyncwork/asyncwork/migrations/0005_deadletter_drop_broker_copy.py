from typing import Any

from django.db import migrations


def unpublished_copies_delete(apps: Any, schema_editor: Any) -> None:
    """The outbox rows of dead letters' copies for the ``dlq`` queue (the only rows ever sent
    to it) not published yet: the relay would publish them onto a queue nothing reads, and the
    dead letter rows are the record."""
    OutboxMessage = apps.get_model("asyncwork", "OutboxMessage")
    OutboxMessage.objects.filter(queue="dlq", published_at__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("asyncwork", "0004_heartbeat_holding"),
    ]

    operations = [
        migrations.RemoveField(model_name="deadletter", name="broker_copy"),
        migrations.RunPython(unpublished_copies_delete, migrations.RunPython.noop, elidable=True),
    ]
