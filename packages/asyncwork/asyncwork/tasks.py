"""Django's task API as asyncwork meets it: the one import of it (``django.tasks`` on Django 6,
the ``django-tasks`` backport on 5.2), the task class of asyncwork's backend (``ReliableTask``:
how a task retries and how long it may run, given to ``@task``), a task found by its module
path (``task_for``), a job as Django's ``TaskResult`` (``task_result``), and the signals the
machinery sends for whoever counts (``asyncwork.contrib.monitoring``). Imports no model: it
loads with the Celery app, before Django's."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import django
from django.dispatch import Signal
from django.utils.module_loading import import_string

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
