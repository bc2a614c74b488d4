"""How a worker runs a job: ``asyncwork.run(job_id)``, the one Celery task every job's message
names (``asyncwork.backend``). The row is the truth; a message only says "look at job n".

1. **Claim.** One ``UPDATE ... RETURNING`` makes the job RUNNING, with this process as its owner
   and a lease to the run's hard time limit, if it is READY and due, or RUNNING under an owner that
   is gone (its heartbeat lapsed, below, or its lease expired). Any other
   message (a duplicate, a stale redelivery, one for a job already done) finds nothing and is
   acknowledged: two messages for one job never run it twice at once.
2. **Run.** The task at the row's module path, with the row's arguments. A path the code does not
   have fails the job, saying so: nothing is dropped silently. A job claimed more often than its
   ``max_attempts`` (its runs ended with no outcome: the worker died each time, a poison job)
   fails too, instead of running again.
3. **Outcome**, written fenced on the claim (a run taken over since writes nothing):
   SUCCESSFUL with the return value; ``TransientError``, a lost database connection or a soft
   time limit with attempts left: READY again, due after a random wait of up to
   ``min(backoff_max, backoff * 2 ** (attempt - 1))`` seconds (longer if the dependency asked,
   ``retry_after``); ``Deferred``: READY again after its cool-down, the attempt given back, until
   its deadline; anything else, or the last attempt: FAILED, and a dead letter with the reason
   (``asyncwork.deadletters``). A declared failure logs no traceback (the row keeps it); any
   other exception is a bug, and its line carries one.

The message is acknowledged once the outcome is written (``acks_late``); a worker killed before
that leaves its job RUNNING until its heartbeat lapses, when the workers' rescue makes it READY
and publishes it again (``asyncwork.rescue``).

**Liveness, by heartbeat.** Every process that runs tasks keeps a ``WorkerHeartbeat`` row,
written every ``WORKER_HEARTBEAT_SECONDS`` by a thread of its own; a claim records
``heartbeat_owner()`` (host, pid, token). An owner is gone when others have beaten without it for
``WORKER_HEARTBEAT_LAPSE_SECONDS`` and its claim is older than that (``owner_lapsed_sql``); ages
are on the database's clock, counted from the newest heartbeat, so neither clock skew nor a
database outage makes live owners look dead. The consumer process beats too, listing the jobs it
holds (``held_jobs``), which the rescue publishes again once it lapsed.
``WORKER_HEARTBEAT_LAPSE_SECONDS=0`` turns rescue by heartbeat off.

**A soft time limit reaches only the task it was set for.** In a prefork worker the soft limit is
a timer in the main process, which sends ``SIGUSR1`` to the pool process while the job is in its
cache of unfinished jobs. If the main loop was held up (reconnecting to a restarted broker), the
timer fires for a finished job, and the signal can interrupt the pool process writing that job's
result: the main process fails to decode it (``Unrecoverable error: UnicodeDecodeError``) and the
worker stops taking tasks (``tests/asyncwork/test_timelimits.py``). So each pool process replaces
billiard's handler with one that raises only while a task runs in it (between ``task_prerun`` and
``task_postrun``) and otherwise ignores the signal with a warning.

Loaded with Django's apps (it reads the models): ``AsyncWorkConfig.ready()`` imports it, which
registers ``run`` with Celery, and connects its receivers (``celery_signals_connect``);
``asyncwork.install`` adds its bootstep by name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery import Task as CeleryTask
from celery import bootsteps, shared_task
from celery.exceptions import Reject, SoftTimeLimitExceeded
from celery.signals import task_postrun, task_prerun, worker_process_init, worker_process_shutdown
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models import Field
from django.utils import timezone

from asyncwork.backend import (
    RUN,
    TaskContext,
    TaskResultStatus,
    job_ran,
    message_id,
    normalize_json,
    task_finished,
    task_for,
    task_result,
    task_started,
)
from asyncwork.deadletters import record
from asyncwork.errors import Deferred, PermanentError, TransientError
from asyncwork.logging import attempt_set
from asyncwork.models import DeadLetter, Job
from asyncwork.periodic import PeriodicThread
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

# What may pass: retried while attempts are left.
RETRIED = (TransientError, SoftTimeLimitExceeded, OperationalError, InterfaceError)

# A run's lease outlives its hard time limit by this: a live run is never taken over.
LEASE_MARGIN_SECONDS = 30.0
# An outcome the database refuses is written again this often, for this long (a PostgreSQL
# restart), before the run is left to its lease.
WRITE_INTERVAL = 1.0
WRITE_WAIT = 10.0


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


# The claim returns the job's columns in its fields' order, named here once: reading the names
# back from the cursor would build a description of every column on every claim.
_JOB_FIELDS = tuple(Job._meta.concrete_fields)

_CLAIM_SQL = f"""
UPDATE {Job._meta.db_table} AS j
SET status = 'RUNNING', attempts = j.attempts + 1, owner = %(owner)s::text,
    lease_expires_at = now() + make_interval(secs => %(lease)s),
    started_at = coalesce(j.started_at, now()), last_attempted_at = now(),
    worker_ids = j.worker_ids || to_jsonb(%(owner)s::text)
WHERE j.id = %(id)s
  AND ((j.status = 'READY' AND (j.due_at IS NULL OR j.due_at <= now()))
       OR (j.status = 'RUNNING' AND (j.lease_expires_at < now()
           OR {owner_lapsed_sql(owner="j.owner", since="j.last_attempted_at")})))
RETURNING {", ".join(f"j.{connection.ops.quote_name(str(f.column))}" for f in _JOB_FIELDS)}
"""  # noqa: S608 - no input: a model's table and columns, and the heartbeat's predicate


@dataclass(frozen=True)
class Run:
    """A claim held: the row as claimed; ``job.owner`` and ``job.attempts`` are its fence."""

    job: Job

    def update(self, **changes: Any) -> int:
        """Write ``changes`` (field names and values) to the job's row if this claim still holds
        it; 0 when the run was taken over. Plain SQL, built once per set of fields: every run
        writes its outcome so, and compiling a ``QuerySet.update()`` costs more than the
        statement."""
        fields, sql = _fenced_update(tuple(changes))
        with connection.cursor() as cursor:
            # The connection itself, not the proxy (asyncwork.db's insert).
            values = [
                f.get_db_prep_save(v, cursor.db)
                for f, v in zip(fields, changes.values(), strict=True)
            ]
            cursor.execute(sql, [*values, self.job.pk, self.job.owner, self.job.attempts])
            return cursor.rowcount


@functools.lru_cache(maxsize=16)
def _fenced_update(names: tuple[str, ...]) -> tuple[list[Field[Any, Any]], str]:
    """The fields named and the SQL of ``Run.update`` setting them."""
    fields, assignments = [], []
    for name in names:
        field = Job._meta.get_field(name)
        assert isinstance(field, Field), name
        assert field.column, name
        fields.append(field)
        assignments.append(f"{connection.ops.quote_name(field.column)} = %s")
    return fields, (
        f"UPDATE {Job._meta.db_table} SET {', '.join(assignments)} "  # noqa: S608 - model metadata
        "WHERE id = %s AND status = 'RUNNING' AND owner = %s AND attempts = %s"
    )


def claim(job_id: int, *, lease_seconds: float) -> Run | None:
    """Make job ``job_id`` RUNNING for this process (above), or None if it is not to run now.
    A database outage is waited out for up to ``WRITE_WAIT``; after that its error is raised,
    and the message must go back to the broker (``asyncwork.install``): the job is READY and
    marked published, so nothing else would publish it again."""
    params: dict[str, int | float | str] = {
        "id": job_id,
        "owner": heartbeat_owner(),
        "lease": lease_seconds + LEASE_MARGIN_SECONDS,
        "heartbeat_lapse": lapse_seconds(),
    }
    started = time.monotonic()
    while True:
        try:
            with connection.cursor() as cursor:
                cursor.execute(_CLAIM_SQL, params)
                row = cursor.fetchone()
        except DatabaseError:
            connection.close()
            if time.monotonic() - started >= WRITE_WAIT:
                raise
            time.sleep(WRITE_INTERVAL)
            continue
        return None if row is None else Run(job=_job_from_row(row))


# Per field of ``Job``, how it reads a value from the database (JSON), if at all.
_READERS = tuple(getattr(field, "from_db_value", None) for field in _JOB_FIELDS)
_ATTNAMES = [field.attname for field in _JOB_FIELDS]


def _job_from_row(row: tuple[Any, ...]) -> Job:
    """A ``Job`` from the claim's row (``_JOB_FIELDS``' columns): ``RawQuerySet`` without its
    per-query set-up."""
    values = [
        value if read is None or value is None else read(value, None, connection)
        for read, value in zip(_READERS, row, strict=True)
    ]
    return Job.from_db(connection.alias, _ATTNAMES, values)


def _written(write: Callable[[], int], *, what: str, job_id: int) -> bool:
    """Run ``write`` (an UPDATE fenced on the claim, or a transaction that starts with one),
    waiting out a database outage of up to ``WRITE_WAIT``; False when it matched nothing (the run
    was taken over) or never got through."""
    started = time.monotonic()
    refused: DatabaseError | None = None
    while True:
        try:
            if write():
                return True
            logger.warning(
                "job %d: %s not recorded: its run was taken over (its worker looked gone)",
                job_id,
                what,
                extra={"job_id": job_id},
            )
            return False
        except DatabaseError as exc:
            connection.close()
            if refused is None:  # a connection cut mid-query (a time limit): a new one at once
                refused = exc
                continue
            if time.monotonic() - started >= WRITE_WAIT:
                logger.error(
                    "job %d: %s not recorded (%s); its lease will give it back",
                    job_id,
                    what,
                    exc,
                    extra={"job_id": job_id},
                )
                return False
            time.sleep(WRITE_INTERVAL)


def _error(exc: BaseException, traceback: str) -> dict[str, str]:
    return {
        "exception_class_path": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "traceback": traceback,
    }


def backoff_seconds(*, attempt: int, backoff: float, backoff_max: float) -> float:
    """Full jitter: a random wait of up to ``min(backoff_max, backoff * 2 ** (attempt - 1))``."""
    return random.uniform(0, min(backoff_max, backoff * 2 ** (attempt - 1)))  # noqa: S311


def _succeed(run: Run, value: Any, *, finished_at: datetime) -> None:
    _written(
        lambda: run.update(
            status=Job.Status.SUCCESSFUL,
            finished_at=finished_at,
            return_value=value,
            owner="",
            lease_expires_at=None,
        ),
        what="its success",
        job_id=run.job.pk,
    )


def _again(run: Run, *, due_in: float, error: dict[str, str] | None, deferred: bool) -> None:
    """READY again, published by the relay once due in ``due_in`` seconds."""
    job, now = run.job, timezone.now()
    changes: dict[str, Any] = {
        "status": Job.Status.READY,
        "due_at": now + timedelta(seconds=due_in),
        "published_at": None,
        "owner": "",
        "lease_expires_at": None,
    }
    if error is not None:
        changes["errors"] = [*job.errors, error]
        changes["first_failed_at"] = job.first_failed_at or now
    if deferred:
        # Not an attempt: given back, with the run's worker id.
        changes["attempts"] = job.attempts - 1
        changes["worker_ids"] = job.worker_ids[:-1]
        changes["deferred_since"] = job.deferred_since or now
    _written(lambda: run.update(**changes), what="its next run", job_id=job.pk)


def _fail(
    run: Run, *, exc: BaseException, traceback: str, reason: str, log_traceback: bool
) -> None:
    """FAILED, and its dead letter, in one transaction."""
    job, now = run.job, timezone.now()

    @transaction.atomic
    def write() -> int:
        failed = run.update(
            status=Job.Status.FAILED,
            finished_at=now,
            errors=[*job.errors, _error(exc, traceback)],
            first_failed_at=job.first_failed_at or now,
            owner="",
            lease_expires_at=None,
        )
        if failed:
            record(
                task=job.task,
                task_id=message_id(job.pk),
                args=list(job.args),
                kwargs=dict(job.kwargs),
                queue=job.queue,
                reason=reason,
                exc=exc,
                traceback=traceback,
                attempts=job.attempts,
                first_failed_at=job.first_failed_at or job.deferred_since or now,
                log_traceback=log_traceback,
            )
        return failed

    _written(write, what="its failure", job_id=job.pk)


def _outcome(run: Run, exc: BaseException, traceback: str) -> str:
    """Write what a failed run leads to; returns it: retry, deferred or failed."""
    job = run.job
    try:
        task = task_for(job.task)
    except LookupError:  # failed before the task was found: the lookup's own error
        task = None
    if isinstance(exc, Deferred):
        since = job.deferred_since or timezone.now()
        waited = (timezone.now() - since).total_seconds()
        if waited < exc.deadline:
            due_in = max(1.0, exc.retry_in + random.uniform(0, exc.jitter))  # noqa: S311
            _again(run, due_in=due_in, error=None, deferred=True)
            logger.info(
                "job deferred %.1f s: %s", due_in, exc, extra={"job_id": job.pk, "deferred": 1}
            )
            return "deferred"
        logger.warning(
            "job deferred for %.0f s, past its deadline of %.0f s: %s",
            waited,
            exc.deadline,
            exc,
            extra={"job_id": job.pk},
        )
        _fail(run, exc=exc, traceback=traceback, reason=exc.dead_letter_reason, log_traceback=False)
        return "failed"
    retried = isinstance(exc, RETRIED)
    if retried and task is not None and job.attempts < task.max_attempts:
        due_in = backoff_seconds(
            attempt=job.attempts, backoff=task.backoff, backoff_max=task.backoff_max
        )
        if isinstance(exc, TransientError) and exc.retry_after:
            # The dependency said when to come back: not sooner (plus up to half again, so the
            # jobs it turned away do not all return at once), nor past the longest wait.
            asked = exc.retry_after * random.uniform(1.0, 1.5)  # noqa: S311
            due_in = max(due_in, min(asked, task.backoff_max))
        _again(run, due_in=due_in, error=_error(exc, traceback), deferred=False)
        logger.info(
            "job failed (attempt %d of %d), retried in %.1f s: %s",
            job.attempts,
            task.max_attempts,
            due_in,
            exc,
            extra={"job_id": job.pk},
        )
        return "retry"
    reason = DeadLetter.Reason.EXHAUSTED if retried else DeadLetter.Reason.PERMANENT
    declared = retried or isinstance(exc, PermanentError | LookupError)
    _fail(
        run,
        exc=exc,
        traceback=traceback,
        reason=getattr(exc, "dead_letter_reason", reason),
        log_traceback=not declared,
    )
    return "failed"


class RedeliveredTooOften(PermanentError):
    """The job was claimed more often than its attempts allow, its earlier runs ending with no
    outcome (the process running it died each time): a poison job, failed instead of run."""

    dead_letter_reason = DeadLetter.Reason.REDELIVERY_LIMIT


def job_run(job_id: int, *, lease_seconds: float) -> str:
    """Claim job ``job_id`` and run it; returns what came of it: ``skipped`` (not to run now),
    ``successful``, ``retry``, ``deferred`` or ``failed``."""
    run = claim(job_id, lease_seconds=lease_seconds)
    if run is None:
        logger.debug("job %d not run: done, not due, or running elsewhere", job_id)
        return "skipped"
    job = run.job
    attempt_set(job.attempts)
    try:
        task = task_for(job.task)
        if job.attempts > task.max_attempts:
            raise RedeliveredTooOften(
                f"claimed {job.attempts} times, more than its {task.max_attempts} attempts: "
                "the runs before ended with no outcome (the worker running it died)"
            )
        result = task_result(task, job)
        backend = type(task.get_backend())
        task_started.send(backend, task_result=result)
        args = [TaskContext(task_result=result), *job.args] if task.takes_context else job.args
        value = normalize_json(task.call(*args, **job.kwargs))
    except Exception as exc:  # noqa: BLE001 - every failure has an outcome, written below
        outcome = _outcome(run, exc, "".join(traceback.format_exception(exc)))
        if outcome == "failed" and "result" in locals():
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "finished_at", timezone.now())
            task_finished.send(backend, task_result=result)
        job_ran.send(job_run, task=job.task, outcome=outcome)
        return outcome
    finished_at = timezone.now()
    _succeed(run, value, finished_at=finished_at)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", finished_at)
    object.__setattr__(result, "_return_value", value)
    task_finished.send(backend, task_result=result)
    job_ran.send(job_run, task=job.task, outcome="successful")
    return "successful"


# A job with no time limit (none on its task, none in Celery's configuration) is taken back only
# when its worker's heartbeat lapses, or after this long.
UNLIMITED_LEASE_SECONDS = 3600.0


class Runner(CeleryTask):
    """``asyncwork.run``: acknowledged after the outcome is written, requeued if the process running
    it is killed (``asyncwork.install.REQUIRED``) or its claim could not be written; it raises
    nothing else, every outcome being on the job's row."""

    ignore_result = True


@shared_task(name=RUN, bind=True, base=Runner)
def run(self: Runner, job_id: int) -> str:
    """Run job ``job_id`` (``job_run``), its lease to the message's hard time limit."""
    limits = self.request.timelimit or (None, None)
    hard = limits[0] or self.app.conf.task_time_limit or UNLIMITED_LEASE_SECONDS
    try:
        return job_run(job_id, lease_seconds=float(hard))
    except (DatabaseError, SoftTimeLimitExceeded) as exc:
        # The claim could not be written: PostgreSQL down past the runner's wait, or out of
        # reach until the run's soft time limit. The message goes back to its queue:
        # acknowledged, it would be gone, and the job, READY and marked published, with it.
        raise Reject(exc, requeue=True) from exc


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


_task_running = threading.Event()
_IGNORED = "soft time limit signal ignored: no task is running in this process (its job ended)"


def _soft_timeout(signum: int, frame: FrameType | None) -> None:
    if _task_running.is_set():
        raise SoftTimeLimitExceeded()
    logger.warning(_IGNORED)


def _task_started(**_: Any) -> None:
    # Only a prefork pool process (billiard's handler installed, main thread) gets the signal.
    if (
        SIG_SOFT_TIMEOUT is not None
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler
    ):
        signal.signal(SIG_SOFT_TIMEOUT, _soft_timeout)
    _task_running.set()


def _task_ended(**_: Any) -> None:
    _task_running.clear()


def celery_signals_connect() -> None:
    """Each prefork child beats from start to exit, and keeps its soft time limit to its task;
    idempotent (``dispatch_uid``)."""
    worker_process_init.connect(heartbeat_start, weak=False, dispatch_uid="asyncwork.runner.beat")
    worker_process_shutdown.connect(
        heartbeat_stop, weak=False, dispatch_uid="asyncwork.runner.unbeat"
    )
    task_prerun.connect(_task_started, weak=False, dispatch_uid="asyncwork.runner.started")
    task_postrun.connect(_task_ended, weak=False, dispatch_uid="asyncwork.runner.ended")
