"""Rows the async machinery keeps. PostgreSQL is every job's source of truth: whatever must not be
lost is a row before it is a message.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.contenttypes.fields import GenericForeignKey
from django.contrib.contenttypes.models import ContentType
from django.db import models
from django.db.models import Q


def job_arguments(args: list[Any]) -> str:
    """A job's arguments as a call writes them: ``7, "a"`` (JSON values, no tuple's comma)."""
    return ", ".join(json.dumps(arg) for arg in args)


class JobQuerySet(models.QuerySet["Job"]):
    def scheduled(self, now: datetime) -> JobQuerySet:
        """Jobs waiting for a time after ``now``: ``run_after``, a retry's backoff, a deferral."""
        return self.filter(published_at__isnull=True, status=Job.Status.READY, due_at__gt=now)


class Job(models.Model):
    """One enqueued task, from the transaction that enqueued it to its result: the outbox row that
    is published to the broker once that transaction commits, and the task's result
    (``django.tasks``' ``TaskResult``, ``asyncwork.backend``). The message carries only its id."""

    class Status(models.TextChoices):
        # django.tasks' TaskResultStatus, by value.
        READY = "READY", "Ready"
        RUNNING = "RUNNING", "Running"
        SUCCESSFUL = "SUCCESSFUL", "Successful"
        FAILED = "FAILED", "Failed"

    task = models.CharField(max_length=200, help_text="The task's module path.")
    args = models.JSONField(default=list, help_text="Ids only, never a snapshot of state.")
    kwargs = models.JSONField(default=dict)
    queue = models.CharField(max_length=100)
    backend = models.CharField(max_length=100, default="default")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.READY)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    due_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Not published before this time (run_after, a retry's backoff, a deferral's "
        "cool-down); empty: at once.",
    )
    published_at = models.DateTimeField(null=True, blank=True)
    publish_attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, help_text="Why the last publish failed.")
    # The run in progress: the process (asyncwork.runner.heartbeat_owner) and when it is surely
    # over.
    owner = models.CharField(max_length=255, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="Runs that spent an attempt.")
    worker_ids = models.JSONField(default=list, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    first_failed_at = models.DateTimeField(null=True, blank=True)
    deferred_since = models.DateTimeField(null=True, blank=True)
    errors = models.JSONField(
        default=list, blank=True, help_text="Each failed run's exception class and traceback."
    )
    return_value = models.JSONField(null=True, blank=True)
    # The log context where it was enqueued (asyncwork.logging): every run's lines carry it.
    context = models.JSONField(default=dict, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        indexes = [
            # "Is a job for this invoice pending?" without a scan.
            models.Index(fields=["task", "args"], name="job_task_args_idx"),
            # The relay's scan and the backlog gauge read only unpublished rows.
            models.Index(
                fields=["created_at"],
                name="job_unpublished_idx",
                condition=Q(published_at__isnull=True),
            ),
            # The workers' poll for jobs come due, once a second each.
            models.Index(
                fields=["due_at"],
                name="job_due_idx",
                condition=Q(published_at__isnull=True, due_at__isnull=False),
            ),
            # The jobs published and not started, which the poll looks at every minute.
            models.Index(
                fields=["published_at"],
                name="job_ready_idx",
                condition=Q(status="READY", published_at__isnull=False),
            ),
            # The rescue's scan of runs in progress: a few rows.
            models.Index(
                fields=["lease_expires_at"],
                name="job_running_idx",
                condition=Q(status="RUNNING"),
            ),
        ]
        permissions = [("republish_job", "Can republish job")]

    def __str__(self) -> str:
        return f"job #{self.pk} {self.task}({job_arguments(self.args)})"


class DeadLetter(models.Model):
    """A job that will not be retried any more: exhausted, or failed permanently."""

    class Reason(models.TextChoices):
        PERMANENT = "permanent", "Permanent failure"
        EXHAUSTED = "exhausted", "Retries exhausted"
        PROVIDER_UNAVAILABLE = "provider_unavailable", "Provider unavailable"
        REDELIVERY_LIMIT = "redelivery_limit", "Redelivered too often"

    task = models.CharField(max_length=200)
    # The failed job's task id: a worker that dies while dead-lettering writes the same row again,
    # not a second one.
    task_id = models.CharField(max_length=255, unique=True)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    queue = models.CharField(max_length=100)
    reason = models.CharField(max_length=32, choices=Reason.choices)
    exception_class = models.CharField(max_length=255, blank=True)
    exception_message = models.TextField(blank=True)
    traceback = models.TextField(blank=True)
    attempts = models.PositiveIntegerField()
    first_failed_at = models.DateTimeField()
    last_failed_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    replayed_at = models.DateTimeField(null=True, blank=True)
    replayed_by = models.CharField(max_length=150, blank=True)
    replay_job = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Resolved: an operator decided the job will not run (the customer paid another way, the
    # address cannot be fixed), and why. No longer waiting; reversible until replayed.
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=150, blank=True)
    resolved_why = models.CharField(max_length=500, blank=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["created_at"],
                name="deadletter_waiting_idx",
                condition=Q(replayed_at__isnull=True, resolved_at__isnull=True),
            ),
        ]
        permissions = [
            ("replay_deadletter", "Can replay dead letter"),
            ("resolve_deadletter", "Can resolve dead letter"),
        ]

    def __str__(self) -> str:
        return f"dead letter #{self.pk} {self.task}({job_arguments(self.args)}) ({self.reason})"


class ScheduledJob(models.Model):
    """What each scheduled job last did, for operators (its lock:
    ``asyncwork.contrib.periodic.locks``)."""

    name = models.CharField(max_length=100, unique=True)
    runs = models.PositiveIntegerField(default=0)
    skips = models.PositiveIntegerField(default=0)
    last_started_at = models.DateTimeField(null=True, blank=True)
    last_finished_at = models.DateTimeField(null=True, blank=True)
    last_skipped_at = models.DateTimeField(null=True, blank=True)
    last_holder = models.CharField(max_length=255, blank=True)
    last_result = models.CharField(max_length=500, blank=True)
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return self.name


class IdempotencyRecord(models.Model):
    """One API request under an ``Idempotency-Key`` (``asyncwork.contrib.idempotency``):
    ``fingerprint`` tells a retry from another request; ``target`` is what the request created,
    or ``response`` the answer it got when that is not one row (a bulk action's)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the request.")
    request = models.CharField(max_length=300, help_text="Method and path, for people.")
    target_type = models.ForeignKey(
        ContentType, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    target_id = models.PositiveBigIntegerField(null=True, blank=True)
    target = GenericForeignKey("target_type", "target_id")
    response = models.JSONField(
        null=True, blank=True, help_text="The answer given, when the request created no one row."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "key"], name="idempotency_user_key_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.request})"


class LockHolder(models.Model):
    """The process that last took each named advisory lock, and its session
    (``asyncwork.contrib.periodic.locks``)."""

    name = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    backend_pid = models.IntegerField()
    backend_start = models.DateTimeField()
    taken_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name}: pid {self.pid} on host {self.host}"


class WorkerHeartbeat(models.Model):
    """One worker process's heartbeat (``asyncwork.runner``): ``owner`` names it (host, pid,
    token), ``beat_at`` is written on the database's clock."""

    owner = models.CharField(max_length=255, unique=True)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    beat_at = models.DateTimeField(db_index=True)
    # The jobs a consumer holds, received and not finished, re-enqueued at once if it dies
    # (asyncwork.rescue).
    holding = models.JSONField(default=list, blank=True)

    def __str__(self) -> str:
        return self.owner
