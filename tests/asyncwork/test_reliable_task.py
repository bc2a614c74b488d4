"""``@reliable_task``: a job's retry policy is a value, and it is what Celery runs with (a real
worker honouring one: ``test_a_retry_waits_as_an_outbox_row_with_nothing_held_in_the_broker``,
tests/asyncwork/test_scheduled.py, with ``tests.flaky``'s two attempts 8 s apart)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from asyncwork.tasks import ReliableTask, RetryPolicy
from celery.utils.time import get_exponential_backoff_interval
from django.conf import settings
from django.core.cache import cache

from invoicing.tasks import EMAIL_RETRY, resend_invoice_email, send_invoice_email
from tests import tasks as test_tasks


@pytest.mark.parametrize("task", [send_invoice_email, resend_invoice_email])
def test_the_email_tasks_run_on_the_policy_their_settings_give(task: Any) -> None:
    assert issubclass(task.__class__, ReliableTask)  # through shared_task's proxy
    assert (
        RetryPolicy(
            attempts=settings.EMAIL_MAX_ATTEMPTS,
            backoff=settings.EMAIL_RETRY_BACKOFF_BASE,
            backoff_max=settings.EMAIL_RETRY_BACKOFF_MAX,
        )
        == EMAIL_RETRY
    )
    assert (task.max_retries, task.retry_backoff, task.retry_backoff_max, task.retry_jitter) == (
        EMAIL_RETRY.attempts - 1,
        EMAIL_RETRY.backoff,
        EMAIL_RETRY.backoff_max,
        True,
    )
    assert (task.acks_late, task.reject_on_worker_lost) == (True, True)
    assert task.soft_time_limit == settings.EMAIL_TASK_SOFT_TIME_LIMIT


def test_the_waits_double_up_to_the_maximum_as_the_policy_says() -> None:
    policy = RetryPolicy(attempts=6, backoff=2, backoff_max=20, jitter=False)
    waits = [
        get_exponential_backoff_interval(
            factor=policy.backoff, retries=n, maximum=policy.backoff_max, full_jitter=False
        )
        for n in range(policy.attempts - 1)
    ]
    assert waits == [2, 4, 8, 16, 20]  # before runs 2 to 6
    task: Any = test_tasks.flaky
    assert (task.max_retries, task.retry_backoff, task.retry_jitter) == (
        1,
        test_tasks.FLAKY_RETRY_SECONDS,
        False,
    )


@pytest.mark.parametrize(
    "given",
    [
        {"attempts": 0},
        {"backoff": 0},
        {"backoff": 10, "backoff_max": 5},
    ],
)
def test_a_policy_that_cannot_run_is_refused(given: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="attempts >= 1 and 1 <= backoff <= backoff_max"):
        RetryPolicy(**given)


def test_a_message_that_names_its_outbox_row_in_a_kwarg_still_runs() -> None:
    """Messages published by earlier versions carry ``outbox_id`` among the kwargs; a job's
    own parameters are its arguments alone, so the task runs without it."""
    key = "legacy-outbox-kwarg"
    result = test_tasks.pid.apply(kwargs={"key": key, "outbox_id": 3})
    assert result.successful(), result.traceback
    assert cache.get(key) == os.getpid()
