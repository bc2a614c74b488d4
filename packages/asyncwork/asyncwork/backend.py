"""asyncwork as Django's task backend: ``TASKS = {"default": {"BACKEND":
"asyncwork.backend.OutboxBackend"}}``, and Django's own ``@task``, ``.enqueue()`` and
``.get_result()`` (``django.tasks`` on Django 6, the ``django-tasks`` backport on 5.2).

What it holds, each by PostgreSQL:

* ``enqueue()`` writes the job's row (``Job``) in the caller's transaction: published to Celery
  once that transaction commits, never run if it rolls back; outside a transaction, at once. A
  publish that fails (the broker down) leaves the row to the workers' relay (below), which
  publishes it once the broker is back.
* Retries are declared on the task: ``@task(max_attempts=5, backoff=2, backoff_max=600)``. Only
  what may pass is retried (``TransientError``, a lost database connection, a soft time limit),
  after a random wait of up to ``backoff * 2 ** (attempt - 1)`` seconds (full jitter), spent as
  the row's due time, not in a worker or the broker; anything else is a bug, and the task fails
  at once (``asyncwork.runner``).
* A task that fails for good is FAILED and a dead letter, with its reason, for an operator to
  replay (``asyncwork.deadletters``).
* ``run_after`` waits in PostgreSQL; ``get_result()`` reads the row: status, attempts, each
  error, the return value. Priorities are not supported: ``priority`` other than 0 is Django's
  own ``InvalidTaskError``.

**The transactional outbox.** A job is a row before it is a message, and nothing is published
before the transaction that wrote the row commits. ``job_create`` writes the row in the caller's
transaction and publishes it on commit, one ``send_task`` bounded by ``OUTBOX_PUBLISH_TIMEOUT``
and confirmed by RabbitMQ before the row is marked. A publish that fails leaves the row to the
relay (``relay``), which every worker runs each second on its poll thread (``asyncwork.poll``),
taking rows ``FOR UPDATE SKIP LOCKED``: the rows its grace period left unpublished, and those
come due (``run_after``, a retry's backoff, a deferral, a rescued run). A crash between a publish
and its mark publishes the job again, which the run's claim absorbs (``asyncwork.runner``).

The message carries the job's id alone (Celery's ``asyncwork.run``, ``RUN``, shown under the
task's own path); the worker reads the rest from the row. A job's first publish goes to its
task's queue; any later one to the queue read ahead of it (``asyncwork.broker``), so a job that
waited is not queued again behind the backlog that arrived meanwhile.

Also Django's task API as asyncwork meets it: the one import of it, the task class of this
backend (``ReliableTask``: how a task retries and how long it may run, given to ``@task``), a
task found by its module path (``task_for``), a job as Django's ``TaskResult``
(``task_result``), and the signals the machinery sends for whoever counts
(``asyncwork.contrib.monitoring``).

Imports no model: a backend is made when a task is declared, which may be before Django's apps
are ready, and the Celery app loads this module (``RUN``) before them. What reads the rows
imports ``Job`` where it runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import django
from celery import current_app
from django.db import connection, transaction
from django.db.models import F, QuerySet
from django.dispatch import Signal
from django.utils import timezone
from django.utils.module_loading import import_string
from kombu.exceptions import OperationalError as BrokerError

from asyncwork import broker
from asyncwork.audit import operator_action_record
from asyncwork.db import insert
from asyncwork.logging import HEADER as LOG_CONTEXT_HEADER
from asyncwork.logging import log_context_current
from asyncwork.settings import asyncwork_settings

if TYPE_CHECKING:
    from asyncwork.models import Job

if TYPE_CHECKING or django.VERSION < (6, 0):  # Django 5.2: the django-tasks backport
    from django_tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json
else:  # Django 6: the same API is Django's own
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.tasks.utils import normalize_json

__all__ = [
    "DEFAULT_TASK_QUEUE_NAME",
    "RUN",
    "BaseTaskBackend",
    "InvalidTaskError",
    "OutboxBackend",
    "ReliableTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "job_publish_failed",
    "job_published",
    "job_ran",
    "normalize_json",
    "rescued",
    "task_enqueued",
    "task_finished",
    "task_started",
]

# The Celery task every job's message names (asyncwork.runner): the one name on the wire.
RUN = "asyncwork.run"

# What the machinery tells whoever counts (asyncwork.contrib.monitoring): after every run of a
# job, its ``task`` (path) and ``outcome`` (successful, retry, deferred or failed); after a job's
# first publish, its ``queue`` and the ``seconds`` since its row was written; after a publish
# the broker refused, its ``queue``; after a rescue gave back work, the ``rescue`` and how many.
job_ran = Signal()
job_published = Signal()
job_publish_failed = Signal()
rescued = Signal()

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliableTask(Task[P, T]):
    """A task of ``OutboxBackend``: Django's ``Task`` and how it retries and how long it may run,
    given to ``@task`` as keyword arguments (the shape of django/new-features#142).

    ``max_attempts`` runs in all, the first included; before run n + 1 a random wait of up to
    ``min(backoff_max, backoff * 2 ** (n - 1))`` seconds (full jitter). ``time_limit``: seconds a
    run may take before ``SoftTimeLimitExceeded`` is raised in it (retried as transient); the
    process running it is killed ``TIME_LIMIT_GRACE`` seconds later. None: Celery's
    ``task_soft_time_limit``, which ``asyncwork.install`` sets."""

    max_attempts: int = 5
    backoff: float = 2.0
    backoff_max: float = 600.0
    time_limit: int | None = None


# Seconds between a run's soft time limit and its process being killed: time to record why.
TIME_LIMIT_GRACE = 15


@functools.lru_cache(maxsize=1024)
def task_for(path: str) -> ReliableTask[Any, Any]:
    """The task at module path ``path``; ``LookupError`` if there is none (a typo, a task since
    removed or renamed, a module the worker cannot import)."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise LookupError(f"no task {path}: {exc}") from exc
    if not isinstance(found, ReliableTask):
        raise LookupError(f"{path} is not a task of asyncwork's backend")
    return found


def task_result(task: Task[Any, Any], job: Any) -> TaskResult[Any]:
    """A ``Job`` row as Django's ``TaskResult``."""
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=str(job.pk),
        status=TaskResultStatus(job.status),
        enqueued_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        last_attempted_at=job.last_attempted_at,
        args=list(job.args),
        kwargs=dict(job.kwargs),
        backend=job.backend,
        errors=[TaskError(**error) for error in job.errors],
        worker_ids=list(job.worker_ids),
    )
    object.__setattr__(result, "_return_value", job.return_value)
    return result


logger = logging.getLogger(__name__)

# Rows per relay batch: drains a backlog quickly, keeps each transaction short. A relay run
# publishes at most RELAY_MAX_BATCHES of them.
RELAY_BATCH_SIZE = 200
RELAY_MAX_BATCHES = 50


def job_create(
    *,
    task: str,
    args: list[Any],
    kwargs: dict[str, Any],
    queue: str,
    backend: str = "default",
    due_at: datetime | None = None,
) -> Job:
    """Record a job in this transaction, published once it commits (or once ``due_at`` comes)."""
    from asyncwork.models import Job

    job = Job(
        task=task,
        args=args,
        kwargs=kwargs,
        queue=queue,
        backend=backend,
        due_at=due_at,
        context=log_context_current(),
    )
    insert(job)
    if due_at is None:
        transaction.on_commit(lambda: _publish_committed(job), robust=True)
    return job


def message_id(job_id: int) -> str:
    """The Celery task id of a job's message: every publish of the job shares it."""
    return f"job-{job_id}"


# The on-commit mark: a raw UPDATE by primary key, cheaper than compiling QuerySet.update() on
# every enqueueing request. A row marked meanwhile keeps its first publish time; one a worker
# has claimed since is left alone (its retry, if it failed already, waits unpublished). Job's
# table by name: this module loads before the models.
_MARK_PUBLISHED = (
    "UPDATE asyncwork_job "
    "SET published_at = coalesce(published_at, now()), publish_attempts = publish_attempts + 1 "
    "WHERE id = %s AND started_at IS NULL"
)


def _published(job: Job) -> None:
    """``job`` was just published: the time since its row was created."""
    age = time.time() - job.created_at.timestamp()
    job_published.send(_published, queue=job.queue, seconds=max(0.0, age))


def _publish_committed(job: Job) -> None:
    """Publish a just-committed row, then mark it: no re-read, no row lock (the relay leaves young
    rows alone). A failed mark leaves the row to the relay: a second message, not a lost one."""
    from asyncwork.models import Job

    error = _send(job, queue=job.queue)
    if error is None:
        _published(job)
        with connection.cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED, [job.pk])
    else:
        Job.objects.filter(pk=job.pk).update(
            publish_attempts=F("publish_attempts") + 1, last_error=repr(error)[:2000]
        )


_local = threading.local()


def _producer() -> Any:
    """This thread's producer, on its own connection with short timeouts and one connection attempt:
    a stalled or refusing broker costs a request at most ``OUTBOX_PUBLISH_TIMEOUT``."""
    producer = getattr(_local, "producer", None)
    if producer is None:
        timeout = asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT
        options = {
            **current_app.conf.broker_transport_options,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # The AMQP transport's names for the same bounds.
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
            # One connection attempt: kombu would otherwise retry for seconds.
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": 0,
            "interval_max": 0,
            "connect_retries_timeout": timeout,
        }
        broker = current_app.connection_for_write(transport_options=options)
        # Closed when its thread ends: py-amqp would leave the socket open.
        weakref.finalize(threading.current_thread(), broker.collect)
        producer = _local.producer = current_app.amqp.Producer(broker, auto_declare=False)
    return producer


def _producer_drop() -> None:
    """Drop this thread's producer without a closing handshake (a stalled broker would hold it)."""
    producer = _local.__dict__.pop("producer", None)
    if producer is not None:
        with contextlib.suppress(Exception):
            producer.connection.collect()


def _time_limits(path: str) -> tuple[int | None, int | None]:
    """The task's own soft and hard time limits for its message (hard ``TIME_LIMIT_GRACE`` after
    soft); none for a task without one, or one the code does not have (the worker fails its
    job, saying so)."""
    try:
        limit = task_for(path).time_limit
    except LookupError:
        return None, None
    return (None, None) if limit is None else (limit, limit + TIME_LIMIT_GRACE)


def _send(job: Job, *, queue: str) -> Exception | None:
    """Publish one job to ``queue`` on this thread's producer. Returns the error instead of
    raising it, and drops the producer, whose connection may be half-broken."""
    timeout = asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT
    soft, hard = _time_limits(job.task)
    try:
        current_app.send_task(
            RUN,
            args=[job.pk],
            queue=queue,
            task_id=message_id(job.pk),
            # Celery's log lines and events name the task, not the runner.
            shadow=job.task,
            headers={LOG_CONTEXT_HEADER: job.context} if job.context else None,
            producer=_producer(),
            # One try: a row whose publish fails waits for the relay, not the request.
            retry=False,
            # The AMQP transport ignores the socket timeout: these bound the write and the confirm
            # on a stalled RabbitMQ node (Redis ignores them).
            timeout=timeout,
            confirm_timeout=timeout,
            add_to_parent=False,
            soft_time_limit=soft,
            time_limit=hard,
        )
    except Exception as exc:  # noqa: BLE001 - any publish failure leaves the row for the relay
        _producer_drop()
        job_publish_failed.send(_send, queue=job.queue)
        # For a broker's nack kombu's own error says nothing; its cause does.
        error = exc.__cause__ if isinstance(exc, BrokerError) and exc.__cause__ else exc
        logger.warning(
            "job publish failed; the relay will retry",
            extra={"job_id": job.pk, "task_name": job.task, "error": repr(error)},
        )
        return error if isinstance(error, Exception) else exc
    return None


def _publish(rows: QuerySet[Job], *, limit: int, actor: str | None = None) -> int:
    """Send up to ``limit`` of ``rows`` no other publisher holds, in id order, each to the queue
    read ahead of its own, and mark them published, in one transaction. Stops at the first broker
    failure: every further row would wait out the same timeout. With an ``actor``, records each
    row's outcome."""
    from asyncwork.models import Job

    published: list[int] = []
    outcomes: dict[int, str] = {}
    with transaction.atomic():
        batch = list(rows.select_for_update(skip_locked=True).order_by("pk")[:limit])
        for job in batch:
            error = _send(job, queue=broker.ahead(job.queue))
            if error is not None:
                # Unpublished again (a failed republish, too), so the relay takes it over.
                Job.objects.filter(pk=job.pk).update(
                    published_at=None,
                    publish_attempts=F("publish_attempts") + 1,
                    last_error=repr(error)[:2000],
                )
                outcomes[job.pk] = f"broker refused, left to the relay: {error!r}"
                break
            published.append(job.pk)
            outcomes[job.pk] = "published"
            if job.published_at is None and job.publish_attempts == 0:
                _published(job)  # a first publish, late: its latency counts
        if actor is not None:
            # Every row asked for, including those another publisher held (a plain read does
            # not wait for their locks) and those after a broker failure.
            for job in rows.order_by("pk"):
                operator_action_record(
                    action="job.republish",
                    actor=actor,
                    target=job,
                    detail=outcomes.get(job.pk)
                    or (
                        "not sent: the broker failed on an earlier job"
                        if job in batch
                        else "skipped: another publisher holds it"
                    ),
                )
        if published:
            Job.objects.filter(pk__in=published).update(
                published_at=timezone.now(), publish_attempts=F("publish_attempts") + 1
            )
    return len(published)


def republish(*, ids: Iterable[int], actor: str) -> int:
    """Publish the given jobs again if they have not started (a message the broker lost after
    taking it); returns how many. A row another publisher holds is skipped, one the broker
    refuses left to the relay; each row's outcome is an operator action of ``actor``."""
    from asyncwork.models import Job

    ids = list(ids)
    if not ids:
        return 0
    rows = Job.objects.filter(pk__in=ids, status=Job.Status.READY)
    return _publish(rows, limit=len(ids), actor=actor)


def relay(*, grace: timedelta | None = None, batch_size: int = RELAY_BATCH_SIZE) -> int:
    """Publish the jobs come due and those left unpublished past the grace period, batch by batch
    (concurrent relays split them); returns how many."""
    from asyncwork.models import Job

    if grace is None:
        grace = timedelta(seconds=asyncwork_settings.OUTBOX_RELAY_GRACE_SECONDS)
    total = 0
    for _ in range(RELAY_MAX_BATCHES):
        now = timezone.now()
        waiting = Job.objects.filter(published_at__isnull=True, status=Job.Status.READY)
        count = _publish(waiting.filter(due_at__lte=now), limit=batch_size)
        if count < batch_size:
            count += _publish(
                waiting.filter(due_at__isnull=True, created_at__lt=now - grace),
                limit=batch_size - count,
            )
        total += count
        if count < batch_size:
            break
    if total:
        logger.info("relay published %d job(s)", total, extra={"published": total})
    return total


class OutboxBackend(BaseTaskBackend):
    task_class = ReliableTask
    supports_defer = True
    supports_get_result = True
    supports_async_task = False
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # The queues a worker reads (asyncwork.broker): TASKS[alias]["QUEUES"], or "default".
        self.queues = set(params.get("QUEUES") or [DEFAULT_TASK_QUEUE_NAME])

    def validate_task(self, task: Task[Any, Any]) -> None:
        super().validate_task(task)
        if not isinstance(task, ReliableTask):
            raise InvalidTaskError(f"{task.module_path} is not a task of this backend")
        if task.max_attempts < 1 or task.backoff <= 0 or task.backoff_max < task.backoff:
            raise InvalidTaskError(
                f"{task.module_path}: a retry policy needs max_attempts >= 1 and "
                "0 < backoff <= backoff_max (seconds)"
            )
        if task.time_limit is not None and task.time_limit <= 0:
            raise InvalidTaskError(f"{task.module_path}: time_limit must be a number of seconds")

    def enqueue(self, task: Task[P, T], args: Any, kwargs: Any) -> TaskResult[T]:
        """Write the job in the current transaction; it is published once that commits."""
        self.validate_task(task)
        job = job_create(
            task=task.module_path,
            args=normalize_json(list(args)),
            kwargs=normalize_json(dict(kwargs)),
            queue=task.queue_name,
            backend=self.alias,
            due_at=task.run_after,
        )
        result = task_result(task, job)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[Any]:
        from asyncwork.models import Job

        try:
            job = Job.objects.get(pk=int(result_id), backend=self.alias)
            task = task_for(job.task)
        except (ValueError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        except LookupError as exc:  # the job's task is gone from the code: no result to give
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from exc
        return task_result(task, job)

    def check(self, **kwargs: Any) -> list[Any]:
        from asyncwork.checks import backend_check

        return backend_check(self)
