"""The rescue of a dead worker process's claims once its heartbeat lapsed (``asyncwork.heartbeat``),
and the dashboard's view of the workers.

An app declares what rescuing its claims means with ``@rescue(name)``. The machinery's own,
``held-jobs``, re-enqueues the jobs a dead consumer held, which the broker would give back only
after its visibility or heartbeat timeout. The ``workers-rescue`` job runs every rescue every
``RESCUE_EVERY``, counts what each rescued (``asyncwork_worker_rescues``) and deletes heartbeat
rows older than ``DEAD_HEARTBEAT_KEPT``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

from django.db import connection, transaction
from django.db.models import Count, Q
from django.db.models.functions import Now
from prometheus_client import Counter

from asyncwork import queues
from asyncwork.heartbeat import lapse_seconds, owner_lapsed_sql
from asyncwork.jobs import job
from asyncwork.models import WorkerHeartbeat
from asyncwork.outbox import outbox_schedule
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

RESCUE_EVERY = timedelta(seconds=2)
# A dead process's row stays this long (shown as lapsed); after that its claims are judged by their
# own age.
DEAD_HEARTBEAT_KEPT = timedelta(hours=1)

RESCUES = Counter(
    "asyncwork_worker_rescues",
    "Claims of a worker process whose heartbeat lapsed that a rescue released and re-enqueued, "
    "by rescue (the name its app declared).",
    ["rescue"],
)

Rescue = Callable[[], int]
_rescues: dict[str, Rescue] = {}
R = TypeVar("R", bound=Rescue)


def rescue(name: str) -> Callable[[R], R]:
    """Declare (or replace) rescue ``name``: it releases the app's claims whose owner is gone
    (``owner_lapsed_sql``), re-enqueues their work and returns how many; safe to run twice."""

    def declare(fn: R) -> R:
        _rescues[name] = fn
        return fn

    return declare


HELD_JOBS = "held-jobs"

_HELD_SQL = f"""
SELECT w.id, w.holding FROM asyncwork_workerheartbeat w
WHERE w.holding <> '[]'::jsonb
  AND {owner_lapsed_sql(owner="w.owner", since="w.started_at")}
ORDER BY w.id
FOR UPDATE SKIP LOCKED
"""  # noqa: S608 - no input: the heartbeat predicate is fixed SQL


def held_jobs_rescue() -> int:
    """Re-enqueue the jobs held by processes whose heartbeat lapsed, onto the queue ahead of each
    one's own, and clear their lists, in one transaction; returns how many. A job the broker also
    brings back later runs again as a no-op."""
    rescued = 0
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_HELD_SQL, {"heartbeat_lapse": lapse_seconds()})
            rows = cursor.fetchall()
        for pk, holding in rows:
            for job in json.loads(holding) if isinstance(holding, str) else holding:
                queue = job.get("queue") or queues.queue_for(job["task"])
                # The same job again, as a redelivery would bring it: its id, its arguments
                # and its retry count; published by the workers' next poll.
                outbox_schedule(
                    task=job["task"],
                    args=list(job.get("args") or ()),
                    kwargs=dict(job.get("kwargs") or {}),
                    queue=queues.queue_ahead(queue),
                    due_in=0,
                    task_id=job["id"],
                    headers={"retries": int(job.get("retries") or 0)},
                )
                rescued += 1
            WorkerHeartbeat.objects.filter(pk=pk).update(holding=[])
    return rescued


@job("workers-rescue", every=RESCUE_EVERY)
def workers_rescue() -> dict[str, int]:
    """Every declared rescue and the held jobs (none while rescue by heartbeat is off), then the
    long-dead rows. Returns how many each rescued or deleted."""
    counts: dict[str, int] = {}
    if lapse_seconds() > 0:
        for name, fn in {**_rescues, HELD_JOBS: held_jobs_rescue}.items():
            counts[name] = rescued = fn()
            if rescued:
                RESCUES.labels(rescue=name).inc(rescued)
                what = "job(s) held by" if name == HELD_JOBS else "claim(s) of"
                logger.warning(
                    "rescue %s: %d %s worker processes whose heartbeat lapsed "
                    "released and re-enqueued",
                    name,
                    rescued,
                    what,
                    extra={"rescue": name, "rescued": rescued},
                )
    deleted, _ = WorkerHeartbeat.objects.filter(beat_at__lt=Now() - DEAD_HEARTBEAT_KEPT).delete()
    counts["heartbeats_deleted"] = deleted
    return counts


@dataclass(frozen=True)
class WorkersProbe:
    """Live worker processes per host, and the lapsed ones still kept."""

    live_by_host: dict[str, int]
    lapsed: int
    lapse_seconds: float

    @property
    def live(self) -> int:
        return sum(self.live_by_host.values())


def workers_probe() -> WorkersProbe:
    """One query, on the database's clock. With rescue off, live means within three heartbeats."""
    lapse = lapse_seconds() or 3 * float(asyncwork_settings.WORKER_HEARTBEAT_SECONDS)
    fresh = Q(beat_at__gte=Now() - timedelta(seconds=lapse))
    rows = (
        WorkerHeartbeat.objects.values("hostname")
        .annotate(live=Count("pk", filter=fresh), lapsed=Count("pk", filter=~fresh))
        .order_by("hostname")
    )
    return WorkersProbe(
        live_by_host={row["hostname"]: row["live"] for row in rows if row["live"]},
        lapsed=sum(row["lapsed"] for row in rows),
        lapse_seconds=lapse,
    )
