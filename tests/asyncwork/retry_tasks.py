"""A task of the retry tests' own (test_scheduled.py), loaded into a worker process with
``include=("tests.asyncwork.retry_tasks",)``: a retry due at a time known in advance, where full
jitter would make it anything from at once to the policy's wait."""

from __future__ import annotations

from django.core.cache import cache
from django_tasks import TaskContext, task

from asyncwork.errors import TransientError

# The dependency asks to be left alone this long, which is also the policy's longest wait: the
# retry is due exactly this long after the first attempt failed (asyncwork.runner: not sooner
# than asked, nor later than the longest wait).
ASKED_SECONDS = 6


@task(takes_context=True, max_attempts=2, backoff=ASKED_SECONDS, backoff_max=ASKED_SECONDS)
def asked_later(context: TaskContext, key: str) -> None:
    """Fails its first attempt as a dependency that asked to be left alone ``ASKED_SECONDS``
    (``retry_after``), then records in the cache under ``key`` the attempt that succeeded."""
    if context.attempt == 1:
        raise TransientError("the dependency asked to come back later", retry_after=ASKED_SECONDS)
    cache.set(key, context.attempt, timeout=300)
