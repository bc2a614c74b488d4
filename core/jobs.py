"""Scheduled jobs: declared here, synced into django-celery-beat by
``manage.py setup_periodic_tasks``, and each run under its own PostgreSQL lock.

Every job is single-owner and safe to run twice:

* ``job_run`` takes the job's advisory lock (``core.locks``) without waiting; a second run
  while the first holds it skips, logs that it skipped, and counts the skip. A run whose
  process dies releases the lock with its database session.
* each job body is idempotent by construction (the outbox relay publishes only unpublished
  rows under SKIP LOCKED; recovery and reconcile enqueue only what has nothing pending; the
  alert deduplicates per period; the purge deletes by age).
* beat dispatches each job with an expiry of one interval, so ticks that piled up while no
  worker ran are dropped rather than run back to back.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Task, shared_task
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from core.db import insert_or_skip
from core.locks import advisory_lock
from core.models import ScheduledJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """One scheduled job: the lock and status name, the task, and when it runs."""

    name: str
    task: str
    every: timedelta | None = None
    # CrontabSchedule fields (minute, hour, ...), in UTC; unnamed fields are "*".
    cron: dict[str, str] | None = None

    @property
    def expires(self) -> int:
        """Seconds after which an undelivered tick is dropped."""
        return int(self.every.total_seconds()) if self.every else 3600


SCHEDULES = (
    Schedule("outbox-relay", "core.outbox_relay", every=timedelta(seconds=15)),
    Schedule("email-claims-recover", "invoicing.recover_stale_claims", every=timedelta(seconds=60)),
    Schedule("email-reconcile", "invoicing.reconcile_paid_invoices", every=timedelta(seconds=120)),
    Schedule("dlq-alert", "core.dlq_alert", every=timedelta(minutes=5)),
    Schedule("retention-purge", "core.retention_purge", cron={"minute": "17", "hour": "3"}),
)


@dataclass(frozen=True)
class JobOutcome:
    ran: bool
    result: Any = None


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def job_run(*, name: str, body: Callable[[], Any]) -> JobOutcome:
    """Run ``body`` as the job ``name`` if no other run holds the job's lock; else skip."""
    insert_or_skip(ScheduledJob(name=name), conflict_fields=["name"])
    jobs = ScheduledJob.objects.filter(name=name)
    with advisory_lock(f"job:{name}") as held:
        if not held:
            jobs.update(skips=F("skips") + 1, last_skipped_at=timezone.now())
            logger.info(
                "job %s skipped: another run holds its lock",
                name,
                extra={"job": name, "outcome": "skipped"},
            )
            return JobOutcome(ran=False)
        jobs.update(runs=F("runs") + 1, last_started_at=timezone.now(), last_holder=_holder())
        try:
            result = body()
        except Exception as exc:
            jobs.update(last_finished_at=timezone.now(), last_error=repr(exc)[:5000])
            logger.exception("job %s failed", name, extra={"job": name, "outcome": "failed"})
            raise
        jobs.update(last_finished_at=timezone.now(), last_result=str(result)[:500], last_error="")
        logger.info(
            "job %s ran: %s",
            name,
            result,
            extra={"job": name, "outcome": "ran", "result": str(result)},
        )
        return JobOutcome(ran=True, result=result)


class JobTask(Task):
    """Scheduled jobs: at-least-once like every task, but not dead-lettered or retried:
    the next tick is the retry, and ``ScheduledJob.last_error`` plus the ERROR log line are
    the record."""

    acks_late = True
    reject_on_worker_lost = True
    max_retries = 0
    # ``job_run`` logs a failed run once, at ERROR with its traceback; Celery's own "raised
    # unexpected" line would repeat both. Listed here, it is one INFO line without them.
    throws = (Exception,)


@shared_task(base=JobTask, name="core.outbox_relay")
def outbox_relay() -> Any:
    from core.outbox import outbox_relay as relay

    return job_run(name="outbox-relay", body=relay).result


@shared_task(base=JobTask, name="core.dlq_alert")
def dlq_alert() -> Any:
    from core.deadletters import dlq_alert as alert

    return job_run(name="dlq-alert", body=alert).result


def retention_purge_run(*, batch: int = 5000) -> dict[str, int]:
    """Delete processed webhook events and published outbox rows past their retention."""
    from core.models import OutboxMessage
    from webhooks.models import WebhookEvent

    now = timezone.now()
    deleted = {"webhook_events": 0, "outbox_messages": 0}
    targets = (
        (
            "webhook_events",
            WebhookEvent.objects.filter(
                received_at__lt=now - timedelta(days=settings.WEBHOOK_RETENTION_DAYS),
                state__in=[WebhookEvent.State.PROCESSED, WebhookEvent.State.IGNORED],
            ),
        ),
        (
            "outbox_messages",
            OutboxMessage.objects.filter(
                published_at__lt=now - timedelta(days=settings.OUTBOX_RETENTION_DAYS)
            ),
        ),
    )
    for label, queryset in targets:
        while True:
            ids = list(queryset.values_list("pk", flat=True)[:batch])
            if not ids:
                break
            count, _ = queryset.model.objects.filter(pk__in=ids).delete()
            deleted[label] += count
    return deleted


@shared_task(base=JobTask, name="core.retention_purge")
def retention_purge() -> Any:
    return job_run(name="retention-purge", body=retention_purge_run).result
