"""The rescue of what a dead worker process held, once its heartbeat lapsed (``asyncwork.runner``),
run by every worker's poll (``asyncwork.poll``) every ``RESCUE_EVERY``; and the dashboard's view
of the workers.

* ``jobs_rescue``: a job RUNNING under an owner whose heartbeat lapsed, or whose lease expired
  (its run outlived its hard time limit: the process was killed), is READY again and published at
  once; its lost run counts as an attempt (``asyncwork.runner``: a job that kills its worker each
  time fails once its attempts are spent). A job a dead consumer had received and not started
  (listed in its heartbeat) is published again: the broker would give it back only after its
  visibility or heartbeat timeout. On Redis, a consumer killed as Redis handed it a message (the
  reply in flight, or not yet recorded as unacknowledged: a killed process closes its sockets only
  after freeing its memory) takes the message with it, and nothing in Redis gives it back: a job
  published within a heartbeat of a dead process's last beat and still not started is published
  again (under a backlog, a second message for some jobs, which does nothing). A message the
  broker brings back later finds the job claimed or done, and does nothing.
* An app declares what rescuing its own claims means with ``@rescue(name)``.

Each is safe to run in every worker at once. Heartbeat rows older than ``DEAD_HEARTBEAT_KEPT`` are
deleted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from django.db import connection, transaction
from django.db.models.functions import Now

from asyncwork.backend import rescued as rescued_signal
from asyncwork.broker import rabbitmq
from asyncwork.models import Job, WorkerHeartbeat
from asyncwork.runner import lapse_seconds, owner_lapsed_sql
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

RESCUE_EVERY = timedelta(seconds=2)
# A dead process's row stays this long (shown as lapsed); after that its claims are judged by their
# own age.
DEAD_HEARTBEAT_KEPT = timedelta(hours=1)

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


JOBS = "jobs"

_RUNNING_SQL = f"""
UPDATE {Job._meta.db_table} AS j
SET status = 'READY', due_at = now(), published_at = NULL, owner = '', lease_expires_at = NULL
WHERE j.status = 'RUNNING'
  AND (j.lease_expires_at < now() OR {
    owner_lapsed_sql(owner="j.owner", since="j.last_attempted_at")
})
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate

_HELD_SQL = f"""
SELECT w.id, w.holding FROM {WorkerHeartbeat._meta.db_table} w
WHERE w.holding <> '[]'::jsonb
  AND {owner_lapsed_sql(owner="w.owner", since="w.started_at")}
ORDER BY w.id
FOR UPDATE SKIP LOCKED
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate


# Published within a heartbeat of a dead process's last beat (its death is within one after it)
# and a second more (the published mark follows the publish), not started: its message may have
# died with a consumer (above). Once published again, its mark is past the window.
_TAKEN_SQL = f"""
UPDATE {Job._meta.db_table} AS j SET published_at = NULL, due_at = now()
FROM {WorkerHeartbeat._meta.db_table} w
WHERE j.status = 'READY' AND j.published_at IS NOT NULL
  AND j.published_at BETWEEN w.beat_at - make_interval(secs => %(heartbeat)s)
                         AND w.beat_at + make_interval(secs => %(heartbeat)s + 1)
  AND {owner_lapsed_sql(owner="w.owner", since="w.started_at")}
"""  # noqa: S608 - no input: the models' table names and the heartbeat's predicate


def jobs_rescue() -> int:
    """Give back the jobs of processes whose heartbeat lapsed (above), in one transaction; returns
    how many."""
    lapse = {"heartbeat_lapse": lapse_seconds()}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_RUNNING_SQL, lapse)
        rescued = cursor.rowcount
        if not rabbitmq():  # RabbitMQ requeues the deliveries of a consumer gone
            heartbeat = float(asyncwork_settings.WORKER_HEARTBEAT_SECONDS)
            cursor.execute(_TAKEN_SQL, {**lapse, "heartbeat": heartbeat})
            rescued += cursor.rowcount
        cursor.execute(_HELD_SQL, lapse)
        # Django's connection reads jsonb as its text.
        rows = [(pk, json.loads(holding)) for pk, holding in cursor.fetchall()]
        held = [job_id for _, holding in rows for job_id in holding]
        if held:
            rescued += Job.objects.filter(
                pk__in=held, status=Job.Status.READY, published_at__isnull=False
            ).update(published_at=None, due_at=Now())
            WorkerHeartbeat.objects.filter(pk__in=[pk for pk, _ in rows]).update(holding=[])
    return rescued


def workers_rescue() -> dict[str, int]:
    """Every declared rescue and the jobs' own (none while rescue by heartbeat is off, but runs
    past their lease), then the long-dead heartbeat rows. Returns how many each rescued or
    deleted."""
    counts: dict[str, int] = {}
    rescues = {**(_rescues if lapse_seconds() > 0 else {}), JOBS: jobs_rescue}
    for name, fn in rescues.items():
        counts[name] = rescued = fn()
        if rescued:
            rescued_signal.send(workers_rescue, rescue=name, count=rescued)
            logger.warning(
                "rescue %s: %d %s of worker processes that are gone released and re-enqueued",
                name,
                rescued,
                "job(s)" if name == JOBS else "claim(s)",
                extra={"rescue": name, "rescued": rescued},
            )
    deleted, _ = WorkerHeartbeat.objects.filter(beat_at__lt=Now() - DEAD_HEARTBEAT_KEPT).delete()
    counts["heartbeats_deleted"] = deleted
    return counts
