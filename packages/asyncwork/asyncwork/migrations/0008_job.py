"""The outbox row becomes the job: ``OutboxMessage`` is renamed ``Job`` and keeps what a run did
(status, attempts, owner and lease, errors, return value); a retry is the same row due later, so
the Celery task id and headers a retry carried are gone. Rows published before are marked
SUCCESSFUL (their outcome was never recorded on the row: a failure is in the dead letters), the
rest READY; heartbeats forget the jobs they listed (a list of job ids now)."""

from django.db import migrations, models
from django.db.models import Q


def statuses(apps, schema_editor):
    Job = apps.get_model("asyncwork", "Job")
    Job.objects.filter(published_at__isnull=False).update(
        status="SUCCESSFUL", finished_at=models.F("published_at")
    )
    apps.get_model("asyncwork", "WorkerHeartbeat").objects.update(holding=[])


class Migration(migrations.Migration):
    dependencies = [("asyncwork", "0007_idempotencyrecord_response")]

    operations = [
        migrations.RemoveIndex(model_name="outboxmessage", name="outbox_task_args_idx"),
        migrations.RemoveIndex(model_name="outboxmessage", name="outbox_unpublished_idx"),
        migrations.RemoveIndex(model_name="outboxmessage", name="outbox_due_idx"),
        migrations.RenameModel(old_name="OutboxMessage", new_name="Job"),
        migrations.AlterModelOptions(
            name="job", options={"permissions": [("republish_job", "Can republish job")]}
        ),
        migrations.RenameField(
            model_name="deadletter", old_name="replay_outbox", new_name="replay_job"
        ),
        migrations.RemoveField(model_name="job", name="task_id"),
        migrations.RemoveField(model_name="job", name="headers"),
        migrations.AlterField(
            model_name="job",
            name="task",
            field=models.CharField(help_text="The task's module path.", max_length=200),
        ),
        migrations.AlterField(
            model_name="job",
            name="due_at",
            field=models.DateTimeField(
                blank=True,
                help_text="Not published before this time (run_after, a retry's backoff, a "
                "deferral's cool-down); empty: at once.",
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="job",
            name="last_error",
            field=models.TextField(blank=True, help_text="Why the last publish failed."),
        ),
        migrations.AddField(
            model_name="job",
            name="backend",
            field=models.CharField(default="default", max_length=100),
        ),
        migrations.AddField(
            model_name="job",
            name="status",
            field=models.CharField(
                choices=[
                    ("READY", "Ready"),
                    ("RUNNING", "Running"),
                    ("SUCCESSFUL", "Successful"),
                    ("FAILED", "Failed"),
                ],
                default="READY",
                max_length=10,
            ),
        ),
        migrations.AddField(
            model_name="job", name="owner", field=models.CharField(blank=True, max_length=255)
        ),
        migrations.AddField(
            model_name="job",
            name="lease_expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="attempts",
            field=models.PositiveIntegerField(default=0, help_text="Runs that spent an attempt."),
        ),
        migrations.AddField(
            model_name="job", name="worker_ids", field=models.JSONField(blank=True, default=list)
        ),
        migrations.AddField(
            model_name="job", name="started_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="job",
            name="last_attempted_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job", name="finished_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="job",
            name="first_failed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="deferred_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="errors",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text="Each failed run's exception class and traceback.",
            ),
        ),
        migrations.AddField(
            model_name="job", name="return_value", field=models.JSONField(blank=True, null=True)
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(fields=["task", "args"], name="job_task_args_idx"),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=Q(published_at__isnull=True),
                fields=["created_at"],
                name="job_unpublished_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=Q(due_at__isnull=False, published_at__isnull=True),
                fields=["due_at"],
                name="job_due_idx",
            ),
        ),
        migrations.AddField(
            model_name="job", name="context", field=models.JSONField(blank=True, default=dict)
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=Q(published_at__isnull=False, status="READY"),
                fields=["published_at"],
                name="job_ready_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=Q(status="RUNNING"), fields=["lease_expires_at"], name="job_running_idx"
            ),
        ),
        migrations.RunPython(statuses, migrations.RunPython.noop, elidable=True),
    ]
