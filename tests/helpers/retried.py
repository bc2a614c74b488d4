"""A task of the tests' own, which a worker runs from its module path (the runner imports it):
its first attempt fails asking to be left alone ``RETRY_SECONDS`` (an HTTP 429's Retry-After),
so its retry waits exactly that long, as its job's row (``TransientError.retry_after``, up to
the task's longest wait, which is that too)."""

from __future__ import annotations

from django.core.cache import cache
from django_tasks import TaskContext, task

from asyncwork.errors import TransientError

RETRY_SECONDS = 8


@task(takes_context=True, max_attempts=2, backoff=RETRY_SECONDS, backoff_max=RETRY_SECONDS)
def retried(context: TaskContext, key: str) -> None:
    """Fails its first attempt (retried ``RETRY_SECONDS`` later), then records in the cache
    under ``key`` the attempt that succeeded."""
    if context.attempt == 1:
        raise TransientError("the first attempt asks for a pause", retry_after=RETRY_SECONDS)
    cache.set(key, context.attempt, timeout=300)
