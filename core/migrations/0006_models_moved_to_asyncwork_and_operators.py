"""core is the project package and keeps no models: its models moved to ``asyncwork`` and
``operators`` (their ``0001`` took the tables and content types), so here core forgets them, in
state only. The database is not touched: the tables are the new apps' now."""

from django.db import migrations


class Migration(migrations.Migration):
    # Not on asyncwork's and operators' 0001, though it forgets what they took: forgetting needs
    # neither, and with them core's squashed migration, which replaces this one, would come both
    # before and after asyncwork 0001 (a cycle) for a database moved but not yet at asyncwork's
    # squashed migration.
    dependencies = [
        ("core", "0005_lockholder"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name="deadletter",
                    name="broker_copy",
                ),
                migrations.RemoveField(
                    model_name="deadletter",
                    name="replay_outbox",
                ),
                migrations.RemoveField(
                    model_name="idempotencyrecord",
                    name="target_type",
                ),
                migrations.RemoveField(
                    model_name="idempotencyrecord",
                    name="user",
                ),
                migrations.DeleteModel(
                    name="LockHolder",
                ),
                migrations.RemoveField(
                    model_name="operatoraction",
                    name="target_type",
                ),
                migrations.DeleteModel(
                    name="ScheduledJob",
                ),
                migrations.DeleteModel(
                    name="DeadLetter",
                ),
                migrations.DeleteModel(
                    name="OutboxMessage",
                ),
                migrations.DeleteModel(
                    name="IdempotencyRecord",
                ),
                migrations.DeleteModel(
                    name="OperatorAction",
                ),
            ],
            database_operations=[],
        ),
    ]
