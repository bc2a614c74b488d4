"""The email tasks' jobs and dead letters under the names the code has now: Celery's task names
(``invoicing.send_invoice_email``) give way to the tasks' module paths, which a job and a dead
letter name (``asyncwork.backend.task_for``). Without this, a job written before (a retry due
later) would fail as a task the code lacks, and a dead letter written before could not be
replayed."""

from typing import Any

from django.db import migrations

RENAMED = {
    "invoicing.send_invoice_email": "invoicing.tasks.send_invoice_email",
    "invoicing.resend_invoice_email": "invoicing.tasks.resend_invoice_email",
}


def _rename(apps: Any, names: dict[str, str]) -> None:
    for model in ("Job", "DeadLetter"):
        rows = apps.get_model("asyncwork", model).objects
        for old, new in names.items():
            rows.filter(task=old).update(task=new)


def forward(apps: Any, schema_editor: Any) -> None:
    _rename(apps, RENAMED)


def backward(apps: Any, schema_editor: Any) -> None:
    _rename(apps, {new: old for old, new in RENAMED.items()})


class Migration(migrations.Migration):
    dependencies = [
        ("invoicing", "0008_email_delivery_provider_message_id"),
        ("asyncwork", "0008_job"),
    ]

    operations = [migrations.RunPython(forward, backward, elidable=True)]
