"""One active beat: django-celery-beat's DatabaseScheduler, dispatching only while it holds the
PostgreSQL advisory lock ``beat-leader``.

Start as many beats as you like: the others try the lock every ``STANDBY_POLL_SECONDS``. It is
held on a connection of its own with TCP keepalives, so a standby takes over within
``STANDBY_POLL_SECONDS`` of the leader's death, or about 20 s more if its host vanished. A leader
that loses its connection stops dispatching at its next tick. The new leader re-reads every
entry's last run (saved after each dispatch, ``CELERY_BEAT_SYNC_EVERY=1``), so a takeover replays
nothing; each job's own lock (``asyncwork.contrib.periodic.jobs``) makes even a split brain run it
once at a time.

``active_beat`` names the leader by host and pid. At start every beat warns about each declared
job with no enabled schedule: it never runs.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import psycopg
from django.db import DatabaseError, connection, connections
from django_celery_beat.schedulers import DatabaseScheduler

from asyncwork.contrib.periodic.jobs import schedules_missing
from asyncwork.contrib.periodic.locks import (
    NAMESPACE,
    Holder,
    lock_holder,
    lock_holder_record,
    lock_key,
)

logger = logging.getLogger(__name__)

# A standby tries the leader lock this often:
# the bound on a takeover.
STANDBY_POLL_SECONDS = 5.0

LEADER_LOCK = "beat-leader"


def _connect() -> psycopg.Connection[Any]:
    # Where Django connects, on a plain psycopg connection (Django's cursor class and adapters are
    # for its own connections).
    params = connections["default"].get_connection_params()
    for django_only in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(django_only, None)
    # Keepalives at both ends: the client's let a leader notice a dead server; the server's (per
    # session) let PostgreSQL drop a vanished leader's session and so release the lock, which it
    # would otherwise keep for the system default of two hours.
    keepalives = "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
    options = " ".join(filter(None, [params.pop("options", ""), keepalives]))
    return psycopg.connect(
        **params,
        autocommit=True,
        application_name=f"beat-leader {socket.gethostname()}:{os.getpid()}",
        options=options,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=5,
        keepalives_count=3,
    )


class LeaderLock:
    """The leader lock on a connection of its own."""

    def __init__(self) -> None:
        self._conn: psycopg.Connection[Any] | None = None

    def held(self) -> bool:
        """True while this process holds the lock; tries to take it when it does not."""
        try:
            if self._conn is not None:
                self._conn.execute("SELECT 1")  # still ours while the session lives
                return True
            conn = _connect()
            row = conn.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", [NAMESPACE, lock_key(LEADER_LOCK)]
            ).fetchone()
            if row and row[0]:
                self._conn = conn
                lock_holder_record(name=LEADER_LOCK, execute=conn.execute)
                return True
            conn.close()
        except psycopg.Error as exc:
            logger.warning("beat leader lock unavailable: %s", exc)
            self.release()
        return False

    def release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                logger.debug("closing the leader connection failed", exc_info=True)
            self._conn = None


class LeaderDatabaseScheduler(DatabaseScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._leader = LeaderLock()
        self._leading = False
        super().__init__(*args, **kwargs)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        for schedule in schedules_missing():
            logger.warning(
                "scheduled job %s (task %s) has no enabled periodic task: it will not run. "
                "manage.py migrate (or manage.py setup_periodic_tasks) creates it",
                schedule.name,
                schedule.name,  # its task's name too
                extra={"job": schedule.name},
            )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._leader.held():
            if self._leading:
                logger.warning("beat lost the leader lock: standing by")
                self._leading = False
            return STANDBY_POLL_SECONDS
        try:
            if not self._leading:
                # A fresh connection: the old one may have died with a PostgreSQL restart.
                connection.close()
                # Start from the database's last-run times, not this process's stale copy.
                self._schedule = self.all_as_schedule()
                self._heap: list[Any] = []
                self._heap_invalidated = True
                logger.info("beat took the leader lock: dispatching")
                self._leading = True
            return float(min(super().tick(*args, **kwargs), STANDBY_POLL_SECONDS))
        except DatabaseError as exc:
            # PostgreSQL restarting: do not die (nothing would dispatch the jobs); try again soon.
            logger.warning("beat could not reach the database (%s); retrying", exc)
            connection.close()
            return STANDBY_POLL_SECONDS

    def close(self) -> None:
        super().close()
        self._leader.release()


def active_beat() -> Holder | None:
    """The beat process dispatching now (its host and pid), or None."""
    connection.ensure_connection()
    return lock_holder(LEADER_LOCK)
