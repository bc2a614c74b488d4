"""core keeps no models, so it has no migration to run: this one replaces core 0001-0006, which
created the machinery's tables and the audit trail's here before ``asyncwork`` and ``operators``
took them (their first migrations create them now, see there). A fresh database applies it
and creates nothing; a database that applied 0001-0006 is at it already; a database that
applied some of 0001-0005 only (from before the move) runs the rest of them, and the move,
from the replaced files.

The replaced files (core 0001-0006), and ``replaces`` here, can go once every deployment has
applied this migration (``manage.py showmigrations core``), in the same change as the files
``asyncwork``'s and ``operators``' first migrations replace."""

from django.db import migrations


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("core", "0001_initial"),
        ("core", "0002_scheduledjob_outboxmessage_outbox_task_args_idx"),
        ("core", "0003_operator_powers_and_actions"),
        ("core", "0004_idempotencyrecord"),
        ("core", "0005_lockholder"),
        ("core", "0006_models_moved_to_asyncwork_and_operators"),
    ]

    dependencies = []

    operations = []
