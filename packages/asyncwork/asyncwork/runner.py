"""How a worker runs a job: ``asyncwork.run(job_id)``, the one Celery task every job's message
names (``asyncwork.outbox``). The row is the truth; a message only says "look at job n".

1. **Claim.** One ``UPDATE ... RETURNING`` makes the job RUNNING, with this process as its owner
   and a lease to the run's hard time limit, if it is READY and due, or RUNNING under an owner that
   is gone (its heartbeat lapsed, ``asyncwork.heartbeat``, or its lease expired). Any other
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
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from asyncwork.deadletters import record
from asyncwork.errors import Deferred, PermanentError, TransientError
from asyncwork.heartbeat import heartbeat_owner, lapse_seconds, owner_lapsed_sql
from asyncwork.logging import attempt_set
from asyncwork.models import DeadLetter, Job
from asyncwork.outbox import message_id
from asyncwork.tasks import (
    TaskContext,
    TaskResultStatus,
    job_ran,
    normalize_json,
    task_finished,
    task_for,
    task_result,
    task_started,
)

logger = logging.getLogger(__name__)

# What may pass: retried while attempts are left.
RETRIED = (TransientError, SoftTimeLimitExceeded, OperationalError, InterfaceError)

# A run's lease outlives its hard time limit by this: a live run is never taken over.
LEASE_MARGIN_SECONDS = 30.0
# An outcome the database refuses is written again this often, for this long (a PostgreSQL
# restart), before the run is left to its lease.
WRITE_INTERVAL = 1.0
WRITE_WAIT = 10.0


_CLAIM_SQL = f"""
UPDATE {Job._meta.db_table} AS j
SET status = 'RUNNING', attempts = j.attempts + 1, owner = %(owner)s,
    lease_expires_at = now() + make_interval(secs => %(lease)s),
    started_at = coalesce(j.started_at, now()), last_attempted_at = now(),
    worker_ids = j.worker_ids || to_jsonb(%(owner)s::text)
WHERE j.id = %(id)s
  AND ((j.status = 'READY' AND (j.due_at IS NULL OR j.due_at <= now()))
       OR (j.status = 'RUNNING' AND (j.lease_expires_at < now()
           OR {owner_lapsed_sql(owner="j.owner", since="j.last_attempted_at")})))
RETURNING j.*
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate


@dataclass(frozen=True)
class Run:
    """A claim held: the row as claimed; ``job.owner`` and ``job.attempts`` are its fence."""

    job: Job

    def held(self) -> Any:
        return Job.objects.filter(
            pk=self.job.pk,
            status=Job.Status.RUNNING,
            owner=self.job.owner,
            attempts=self.job.attempts,
        )


def claim(job_id: int, *, lease_seconds: float) -> Run | None:
    """Make job ``job_id`` RUNNING for this process (above), or None if it is not to run now.
    A database outage is waited out for up to ``WRITE_WAIT``; after that its error is raised,
    and the message must go back to the broker (``asyncwork.install``): the job is READY and
    marked published, so nothing else would publish it again."""
    params = {
        "id": job_id,
        "owner": heartbeat_owner(),
        "lease": lease_seconds + LEASE_MARGIN_SECONDS,
        "heartbeat_lapse": lapse_seconds(),
    }
    started = time.monotonic()
    while True:
        try:
            claimed = list(Job.objects.raw(_CLAIM_SQL, params))
        except DatabaseError:
            connection.close()
            if time.monotonic() - started >= WRITE_WAIT:
                raise
            time.sleep(WRITE_INTERVAL)
            continue
        return Run(job=claimed[0]) if claimed else None


def _written(write: Callable[[], int], *, what: str, job_id: int) -> bool:
    """Run ``write`` (an UPDATE fenced on the claim), waiting out a database outage of up to
    ``WRITE_WAIT``; False when it matched nothing (the run was taken over) or never got through."""
    started = time.monotonic()
    refused: DatabaseError | None = None
    while True:
        try:
            with transaction.atomic():
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


def _succeed(run: Run, value: Any) -> None:
    _written(
        lambda: run.held().update(
            status=Job.Status.SUCCESSFUL,
            finished_at=timezone.now(),
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
    _written(lambda: run.held().update(**changes), what="its next run", job_id=job.pk)


def _fail(
    run: Run, *, exc: BaseException, traceback: str, reason: str, log_traceback: bool
) -> None:
    """FAILED, and its dead letter, in one transaction."""
    job, now = run.job, timezone.now()

    def write() -> int:
        failed = run.held().update(
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
    _succeed(run, value)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(backend, task_result=result)
    job_ran.send(job_run, task=job.task, outcome="successful")
    return "successful"
