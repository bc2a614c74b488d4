"""asyncwork as Django's task backend: ``TASKS = {"default": {"BACKEND":
"asyncwork.backend.OutboxBackend"}}``, and Django's own ``@task``, ``.enqueue()`` and
``.get_result()`` (``django.tasks`` on Django 6, the ``django-tasks`` backport on 5.2).

What it holds, each by PostgreSQL:

* ``enqueue()`` writes the job's row (``Job``) in the caller's transaction: published to Celery
  once that transaction commits, never run if it rolls back; outside a transaction, at once. A
  publish that fails (the broker down) leaves the row to the workers' relay
  (``asyncwork.outbox``), which publishes it once the broker is back.
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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from django.dispatch import Signal
from django.utils.module_loading import import_string

try:  # Django 6: the task framework is Django's own
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.tasks.utils import normalize_json
except ImportError:  # Django 5.2: the django-tasks backport, the same API
    from django_tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

__all__ = [
    "DEFAULT_TASK_QUEUE_NAME",
    "RUN",
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

# The Celery task every job's message names (asyncwork.install): the one name on the wire.
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
    time_limit: float | None = None


# Seconds between a run's soft time limit and its process being killed: time to record why.
TIME_LIMIT_GRACE = 15.0


class OutboxBackend(BaseTaskBackend):
    task_class = ReliableTask
    supports_defer = True
    supports_get_result = True
    supports_async_task = False
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # The queues a worker reads (asyncwork.queues): TASKS[alias]["QUEUES"], or "default".
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
        from asyncwork import outbox  # the models are loaded only once Django is set up

        self.validate_task(task)
        job = outbox.job_create(
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
