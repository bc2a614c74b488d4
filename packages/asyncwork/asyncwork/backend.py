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

from typing import Any, ParamSpec, TypeVar

from asyncwork.tasks import (
    DEFAULT_TASK_QUEUE_NAME,
    BaseTaskBackend,
    InvalidTaskError,
    ReliableTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    normalize_json,
    task_enqueued,
    task_for,
    task_result,
)

P = ParamSpec("P")
T = TypeVar("T")


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
        # The models load with Django's apps; a backend is made when a task is declared, which
        # may be before they are.
        from asyncwork.outbox import job_create

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
