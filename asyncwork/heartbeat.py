"""Worker liveness by heartbeat: who owns a claim, and whether that owner is gone.

Every process that runs tasks (each prefork child, or the worker's own process under the solo
and threads pools) keeps a ``WorkerHeartbeat`` row: a thread of its own writes ``beat_at`` with
the database's clock (``now()``) every ``WORKER_HEARTBEAT_SECONDS``. ``heartbeat_owner()``
names the process (host, pid and a random token, so a reused pid is another owner); a task
that claims work records that name, and the claim then belongs to a process whose liveness
anyone can read.

A claim's owner is *gone* when it has written no heartbeat for ``WORKER_HEARTBEAT_LAPSE_SECONDS``
and the claim itself is older than that (an owner that never wrote one, or whose row was
cleaned, counts from its claim): ``owner_lapsed_sql``, one SQL predicate a domain puts in its
own claim statement and rescue query. Every age is read on the database's clock, never a
host's, so skew between hosts cannot make a live owner look dead; and it is counted back from
the newest heartbeat of any process rather than from ``now()``, so a database restart or stall,
during which nobody could write one, does not make every owner look dead at once: an owner is
gone only once others have beaten without it for the whole lapse. A live but slow owner keeps
its heartbeat fresh and is never overtaken: for it the claim's lease stays the fence.

What a gone owner's claims become is the domain's to say; ``asyncwork.rescue`` runs it at once
(the ``workers-rescue`` job) and cleans the rows of long-dead processes. A process that exits
cleanly deletes its own row.

The worker's own process (the consumer, which receives the messages; under prefork it runs no
task) beats too, and with each beat lists the jobs it holds: received and not finished
(``held_jobs``: reserved, running, or waiting for an ETA). If it dies, those messages come back
only when the broker redelivers them (on Redis, after the visibility timeout); once its
heartbeat lapsed, the rescue re-enqueues its jobs at once (``asyncwork.rescue``). A job that
finished since the last beat, or a message redelivered later as well, runs again as a no-op:
every job is safe to run twice.

``WORKER_HEARTBEAT_LAPSE_SECONDS=0`` turns rescue by heartbeat off (the lease alone decides);
the heartbeats are still written, for the dashboard.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.signals import worker_process_init, worker_process_shutdown
from django.conf import settings
from django.db import DatabaseError, connection

from asyncwork import queues
from asyncwork.periodic import PeriodicThread

logger = logging.getLogger(__name__)

# ``asyncwork.models.WorkerHeartbeat``'s table, named here because this module is imported
# with the Celery app, before Django's models are loaded (a test checks the two agree).
TABLE = "asyncwork_workerheartbeat"

_owner: tuple[int, str] | None = None


def heartbeat_owner() -> str:
    """This process's name as a claim owner: ``<host>:<pid>:<token>``, a new token in a new
    (or forked) process."""
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
    return _owner[1]


def lapse_seconds() -> float:
    return float(settings.WORKER_HEARTBEAT_LAPSE_SECONDS)


def owner_lapsed_sql(*, owner: str, since: str) -> str:
    """An SQL predicate, true when the process named by the column ``owner`` is gone: rescue by
    heartbeat is on, and for longer than the lapse before the newest heartbeat of any process,
    it wrote none and its claim (made at the column ``since``) already existed. Its one
    parameter is ``%(heartbeat_lapse)s``: pass ``lapse_seconds()``.

    Measured against the newest heartbeat, which is never later than the database's ``now()``:
    when nobody could write one (the database restarting, stalled, or cut off from every
    worker), nobody is judged gone, and no process is judged gone until others have beaten
    without it for the whole lapse. With no heartbeat at all (no worker beats yet), nothing
    is."""
    # Aliases of its own, which a caller's query is unlikely to use for its own tables.
    newest = "(SELECT max(lapse_n.beat_at) FROM asyncwork_workerheartbeat lapse_n)"
    fresh = f"{newest} - make_interval(secs => %(heartbeat_lapse)s)"
    # No input: a table name and the caller's own columns.
    return (
        f"(%(heartbeat_lapse)s > 0"  # noqa: S608
        f" AND NOT EXISTS (SELECT 1 FROM {TABLE} lapse_h"
        f" WHERE lapse_h.owner = {owner} AND lapse_h.beat_at >= {fresh})"
        f" AND {since} < {fresh})"
    )


_BEAT_SQL = """
INSERT INTO asyncwork_workerheartbeat (owner, hostname, pid, started_at, beat_at, holding)
VALUES (%(owner)s, %(hostname)s, %(pid)s, now(), now(), %(holding)s::jsonb)
ON CONFLICT (owner) DO UPDATE SET beat_at = now(), holding = EXCLUDED.holding
"""


def held_jobs() -> list[dict[str, Any]]:
    """The jobs of this worker process's consumer (``ReliableTask``s: scheduled jobs are
    beat's, dispatched again at their next period) received and not finished, each as what
    re-enqueueing it takes: task, id, args, kwargs, the queue it came from, its retry count."""
    from celery.worker import state

    from asyncwork.tasks import ReliableTask  # the models are loaded by the first beat

    for _ in range(3):  # the consumer's thread changes the dict while this one copies it
        try:
            requests = list(state.requests.values())
            break
        except RuntimeError:
            continue
    else:
        return []
    return [
        {
            "task": request.name,
            "id": request.id,
            "args": list(request.args or ()),
            "kwargs": dict(request.kwargs or {}),
            "queue": queues.queue_delivered(request.delivery_info, request.name),
            "retries": int(getattr(request, "retries", 0) or 0),
        }
        for request in requests
        if isinstance(request.task, ReliableTask)
    ]


_DELETE_SQL = "DELETE FROM asyncwork_workerheartbeat WHERE owner = %(owner)s"


class Heartbeat(PeriodicThread):
    """The heartbeat thread of one process: beats at once, then every ``interval`` seconds,
    on a database connection of its own; deletes its row when stopped."""

    def __init__(
        self, *, interval: float, holding: Callable[[], list[dict[str, Any]]] | None = None
    ) -> None:
        self.holding = holding
        self.owner = heartbeat_owner()
        super().__init__(
            name="asyncwork-heartbeat",
            interval=interval,
            logger=logger,
            failed="worker heartbeat not written: %s",
            recovered="worker heartbeat written again",
            at_once=True,
            extra={"owner": self.owner},
        )

    def beat(self) -> None:
        holding = json.dumps(self.holding() if self.holding else [], default=str)
        self.guarded(lambda: self._write(holding), None)

    def _write(self, holding: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                _BEAT_SQL,
                {
                    "owner": self.owner,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "holding": holding,
                },
            )

    def tick(self) -> None:
        self.beat()

    def at_stop(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(_DELETE_SQL, {"owner": self.owner})
        except DatabaseError as exc:
            logger.info("worker heartbeat row not deleted: %s", exc, extra={"owner": self.owner})


_running: Heartbeat | None = None


def heartbeat_start(*, holding: Callable[[], list[dict[str, Any]]] | None = None, **_: Any) -> None:
    """Start this process's heartbeat thread (once per process); ``holding``: what it lists
    as the jobs it holds (the consumer's process: ``held_jobs``)."""
    global _running
    if _running is not None and _running.owner == heartbeat_owner():
        return
    _running = Heartbeat(interval=float(settings.WORKER_HEARTBEAT_SECONDS), holding=holding)
    _running.start()


def heartbeat_stop(**_: Any) -> None:
    """Stop this process's heartbeat thread and delete its row."""
    global _running
    if _running is not None and _running.owner == heartbeat_owner():
        _running.stop()
    _running = None


class WorkerHeartbeatStep(bootsteps.StartStopStep):
    """The heartbeat of the worker's own process, which lists the jobs it holds (and, under a
    pool that runs tasks there, solo or threads, owns their claims). Prefork children start
    theirs on ``worker_process_init``."""

    label = "Heartbeat"

    def start(self, parent: Any) -> None:
        heartbeat_start(holding=held_jobs)

    def stop(self, parent: Any) -> None:
        heartbeat_stop()

    def terminate(self, parent: Any) -> None:  # a cold shutdown: its row goes all the same
        self.stop(parent)


def celery_signals_connect() -> None:
    """Each prefork child beats from its start to its exit (idempotent: ``dispatch_uid``)."""
    worker_process_init.connect(
        heartbeat_start, weak=False, dispatch_uid="asyncwork.heartbeat.start"
    )
    worker_process_shutdown.connect(
        heartbeat_stop, weak=False, dispatch_uid="asyncwork.heartbeat.stop"
    )
