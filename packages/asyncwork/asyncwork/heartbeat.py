"""Worker liveness by heartbeat: who owns a claim, and whether that owner is gone.

Every process that runs tasks keeps a ``WorkerHeartbeat`` row, written every
``WORKER_HEARTBEAT_SECONDS`` by a thread of its own; a task that claims work records
``heartbeat_owner()`` (host, pid, token). An owner is gone when others have beaten without it for
``WORKER_HEARTBEAT_LAPSE_SECONDS`` and its claim is older than that (``owner_lapsed_sql``); ages
are on the database's clock, counted from the newest heartbeat, so neither clock skew nor a
database outage makes live owners look dead. What a gone owner's claims become is the domain's
(``asyncwork.rescue``).

The consumer process beats too, listing the jobs it holds (``held_jobs``), which the rescue
publishes again once it lapsed. ``WORKER_HEARTBEAT_LAPSE_SECONDS=0`` turns rescue by heartbeat off.
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
from django.db import DatabaseError, connection

from asyncwork.periodic import PeriodicThread
from asyncwork.settings import asyncwork_settings
from asyncwork.tasks import RUN

logger = logging.getLogger(__name__)

_owner: tuple[int, str] | None = None


def heartbeat_owner() -> str:
    """This process's claim-owner name, ``<host>:<pid>:<token>``; a new token after a fork."""
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        _owner = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}")
    return _owner[1]


def lapse_seconds() -> float:
    return float(asyncwork_settings.WORKER_HEARTBEAT_LAPSE_SECONDS)


def owner_lapsed_sql(*, owner: str, since: str) -> str:
    """An SQL predicate: the process named by column ``owner`` is gone (as above), its claim being
    column ``since``. Parameter ``%(heartbeat_lapse)s``: ``lapse_seconds()``."""
    # Aliases of its own, which a caller's query is unlikely to use for its own tables.
    newest = "(SELECT max(lapse_n.beat_at) FROM asyncwork_workerheartbeat lapse_n)"
    fresh = f"{newest} - make_interval(secs => %(heartbeat_lapse)s)"
    return (
        f"(%(heartbeat_lapse)s > 0"  # noqa: S608 - no input: the caller's own columns
        " AND NOT EXISTS (SELECT 1 FROM asyncwork_workerheartbeat lapse_h"
        f" WHERE lapse_h.owner = {owner} AND lapse_h.beat_at >= {fresh})"
        f" AND {since} < {fresh})"
    )


_BEAT_SQL = """
INSERT INTO asyncwork_workerheartbeat (owner, hostname, pid, started_at, beat_at, holding)
VALUES (%(owner)s, %(hostname)s, %(pid)s, now(), now(), %(holding)s::jsonb)
ON CONFLICT (owner) DO UPDATE SET beat_at = now(), holding = EXCLUDED.holding
"""


def held_jobs() -> list[int]:
    """The ids of the jobs this consumer received and has not finished, for the rescue."""
    from celery.worker import state

    for _ in range(3):  # the consumer's thread changes the dict while this one copies it
        try:
            requests = list(state.requests.values())
            break
        except RuntimeError:
            continue
    else:
        return []
    # The type, not the name: a job's message shows the name of its task (``shadow``).
    return [int(request.args[0]) for request in requests if request.type == RUN and request.args]


_DELETE_SQL = "DELETE FROM asyncwork_workerheartbeat WHERE owner = %(owner)s"


class Heartbeat(PeriodicThread):
    """One process's heartbeat thread: beats at once, then every ``interval`` seconds, on a
    connection of its own; deletes its row when stopped."""

    def __init__(self, *, interval: float, holding: Callable[[], list[int]] | None = None) -> None:
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

    def tick(self) -> None:
        params: dict[str, str | int] = {
            "owner": self.owner,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "holding": json.dumps(self.holding() if self.holding else [], default=str),
        }

        def write() -> None:
            with connection.cursor() as cursor:
                cursor.execute(_BEAT_SQL, params)

        self.guarded(write, None)

    def at_stop(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(_DELETE_SQL, {"owner": self.owner})
        except DatabaseError as exc:
            logger.info("worker heartbeat row not deleted: %s", exc, extra={"owner": self.owner})


_running: Heartbeat | None = None


def heartbeat_start(*, holding: Callable[[], list[int]] | None = None, **_: Any) -> None:
    """Start this process's heartbeat thread once; ``holding``: its held jobs (the consumer's)."""
    global _running
    if _running is not None and _running.owner == heartbeat_owner():
        return
    _running = Heartbeat(
        interval=float(asyncwork_settings.WORKER_HEARTBEAT_SECONDS), holding=holding
    )
    _running.start()


def heartbeat_stop(**_: Any) -> None:
    global _running
    if _running is not None and _running.owner == heartbeat_owner():
        _running.stop()
    _running = None


class WorkerHeartbeatStep(bootsteps.StartStopStep):
    """The heartbeat of the worker's own process, listing the jobs it holds. Prefork children start
    theirs on ``worker_process_init``."""

    label = "Heartbeat"

    def start(self, parent: Any) -> None:
        heartbeat_start(holding=held_jobs)

    def stop(self, parent: Any) -> None:
        heartbeat_stop()

    def terminate(self, parent: Any) -> None:  # a cold shutdown: its row goes all the same
        self.stop(parent)


def celery_signals_connect() -> None:
    """Each prefork child beats from start to exit; idempotent (``dispatch_uid``)."""
    worker_process_init.connect(
        heartbeat_start, weak=False, dispatch_uid="asyncwork.heartbeat.start"
    )
    worker_process_shutdown.connect(
        heartbeat_stop, weak=False, dispatch_uid="asyncwork.heartbeat.stop"
    )
