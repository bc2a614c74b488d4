"""Scheduled jobs: declared where they are defined (``@job``), synced into django-celery-beat, each
run under its own PostgreSQL lock.

A job's one name is its task's, its lock's (``job:<name>``) and its ``ScheduledJob`` row's.
``schedules_sync`` runs after every ``migrate``: idempotent, and concurrent runs take turns.
``job_run`` takes the lock without waiting, so a second run skips; each body is idempotent; a
tick expires after one interval, so ticks piled up while no worker ran are dropped.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO, TypeVar

from celery import Task, shared_task
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.migrations.loader import MigrationLoader
from django.db.models import F
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from asyncwork.contrib.periodic.locks import Holder, advisory_lock, advisory_xact_lock
from asyncwork.db import insert_or_skip
from asyncwork.models import ScheduledJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One scheduled job; ``run`` is its body."""

    name: str
    run: Callable[[], Any]
    every: timedelta | None = None
    # CrontabSchedule fields (minute, hour, ...), in UTC; unnamed fields are "*".
    cron: dict[str, str] | None = None

    @property
    def expires(self) -> int:
        """Seconds after which an undelivered tick is dropped."""
        return int(self.every.total_seconds()) if self.every else 3600


_jobs: dict[str, Job] = {}
_tasks: dict[str, Task] = {}
Run = TypeVar("Run", bound=Callable[[], Any])


def job(
    name: str, *, every: timedelta | None = None, cron: dict[str, str] | None = None
) -> Callable[[Run], Run]:
    """Declare the decorated function (returned unchanged) the body of job ``name``, run every
    ``every`` or on ``cron``."""
    if (every is None) == (cron is None):
        raise ValueError("a job runs either every interval or on a crontab")

    def declare(run: Run) -> Run:
        _jobs[name] = Job(name=name, run=run, every=every, cron=cron)

        def body() -> Any:
            return job_run(name=name, body=run).result

        body.__name__ = body.__qualname__ = run.__name__
        body.__module__ = run.__module__
        _tasks[name] = shared_task(base=JobTask, name=name)(body)
        return run

    return declare


def job_task(name: str) -> Task:
    return _tasks[name]


def jobs_declared() -> tuple[Job, ...]:
    """Every declared job, in the order declared."""
    return tuple(_jobs.values())


# The description of each periodic task schedules_sync manages; it finds them by its start.
MANAGED_BY = "Managed by manage.py setup_periodic_tasks"
MANAGED = f"{MANAGED_BY} (declared with asyncwork.contrib.periodic.jobs.job)."
SYNC_LOCK = "schedules-sync"


def schedules_sync() -> dict[str, int]:
    """Create or update each declared job's periodic task and ``ScheduledJob`` row, and disable the
    managed tasks no longer declared. Returns counts: created, updated, unchanged, disabled."""
    counts = {"created": 0, "updated": 0, "unchanged": 0, "disabled": 0}
    with transaction.atomic():
        # A second sync waits for the first, then finds nothing to do: IntervalSchedule has
        # no unique constraint for get_or_create to lean on.
        advisory_xact_lock(SYNC_LOCK)
        for schedule in jobs_declared():
            fields: dict[str, Any] = {
                "task": schedule.name,
                "enabled": True,
                "description": MANAGED,
                "expire_seconds": schedule.expires,
                "args": "[]",
                "interval": None,
                "crontab": None,
            }
            if schedule.every is not None:
                fields["interval"], _ = IntervalSchedule.objects.get_or_create(
                    every=int(schedule.every.total_seconds()), period=IntervalSchedule.SECONDS
                )
            elif schedule.cron is not None:
                fields["crontab"], _ = CrontabSchedule.objects.get_or_create(
                    timezone="UTC", **schedule.cron
                )
            task = PeriodicTask.objects.filter(name=schedule.name).first()
            if task is None:
                PeriodicTask.objects.create(name=schedule.name, **fields)
                counts["created"] += 1
            elif any(getattr(task, k) != v for k, v in fields.items()):
                for key, value in fields.items():
                    setattr(task, key, value)
                task.save()  # through the model: beat notices the change
                counts["updated"] += 1
            else:
                counts["unchanged"] += 1
            insert_or_skip(ScheduledJob(name=schedule.name), conflict_fields=["name"])
        stale = PeriodicTask.objects.filter(
            description__startswith=MANAGED_BY, enabled=True
        ).exclude(name__in=[s.name for s in jobs_declared()])
        for task in stale:
            task.enabled = False
            task.save()
            counts["disabled"] += 1
    return counts


def schedules_sync_summary(*, counts: dict[str, int]) -> str:
    return "periodic tasks: " + ", ".join(f"{n} {k}" for k, n in counts.items())


def schedules_missing() -> list[Job]:
    """The declared jobs with no enabled periodic task running them: beat never dispatches them."""
    scheduled = set(PeriodicTask.objects.filter(enabled=True).values_list("name", "task"))
    return [s for s in jobs_declared() if (s.name, s.name) not in scheduled]


def schedules_sync_after_migrate(
    *, using: str = DEFAULT_DB_ALIAS, verbosity: int = 1, stdout: TextIO | None = None, **_: Any
) -> None:
    """``post_migrate`` receiver: sync the schedules, on the default database once every
    django-celery-beat and asyncwork migration is applied."""
    if using != DEFAULT_DB_ALIAS:
        return
    loader = MigrationLoader(connections[using], ignore_no_migrations=True)
    wanted = {node for node in loader.graph.nodes if node[0] in ("django_celery_beat", "asyncwork")}
    if wanted <= set(loader.applied_migrations):
        said = schedules_sync_summary(counts=schedules_sync())
    else:
        said = (
            "periodic tasks not synced: django_celery_beat or asyncwork has unapplied "
            "migrations (manage.py migrate, or manage.py setup_periodic_tasks after it)"
        )
    if verbosity >= 1 and stdout is not None:
        stdout.write(said + "\n")


@dataclass(frozen=True)
class JobOutcome:
    ran: bool
    result: Any = None


def job_run(*, name: str, body: Callable[[], Any]) -> JobOutcome:
    """Run ``body`` as the job ``name`` if no other run holds the job's lock; else skip. Its line
    is at INFO when ``body`` returned something true (it found something), else at DEBUG."""
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
        # Worded as asyncwork.contrib.periodic.locks.Holder, so both columns read alike.
        holder = str(Holder(host=socket.gethostname(), pid=os.getpid()))
        jobs.update(runs=F("runs") + 1, last_started_at=timezone.now(), last_holder=holder)
        try:
            result = body()
        except Exception as exc:
            jobs.update(last_finished_at=timezone.now(), last_error=repr(exc)[:5000])
            logger.exception("job %s failed", name, extra={"job": name, "outcome": "failed"})
            raise
        jobs.update(last_finished_at=timezone.now(), last_result=str(result)[:500], last_error="")
        # A run that found nothing (a falsy result: 0, an empty collection, an object that says
        # so) is routine: at INFO an idle worker writes nothing.
        logger.log(
            logging.INFO if result else logging.DEBUG,
            "job %s ran: %s",
            name,
            result,
            extra={"job": name, "outcome": "ran", "result": str(result)},
        )
        return JobOutcome(ran=True, result=result)


class JobTask(Task):
    """Scheduled jobs' base: at-least-once, never retried nor dead-lettered; the next tick is the
    retry, ``ScheduledJob.last_error`` and the ERROR line the record (at-least-once:
    ``asyncwork.install.REQUIRED``)."""

    max_retries = 0
    # Celery's "received" and "succeeded" lines of a run, at DEBUG: job_run's own line says what
    # it found (asyncwork.contrib.logging.RoutineRunFilter, in the project's LOGGING).
    routine = True
    # job_run logs a failure once, with its traceback; in ``throws``, Celery's own line is INFO
    # without one.
    throws = (Exception,)
