"""What the worker's runner (asyncwork.runner) does with a task's own policy, for the application's
tasks and the tests' (tests/tasks.py), through real workers on PostgreSQL and Redis: a transient
failure is retried after a random wait of up to the policy's (full jitter), a bug fails at once, a
job that kills its worker every time fails as ``redelivery_limit`` once its attempts are spent, and
a run cut by its soft time limit is retried. The email tasks run on the policy their settings
give, and their messages carry their time limits. (A retry waits in PostgreSQL, on both brokers:
test_scheduled.py.)"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import cache
from django_tasks import task
from django_tasks.exceptions import InvalidTaskError

from asyncwork.backend import RUN, TIME_LIMIT_GRACE, ReliableTask, message_id
from asyncwork.models import DeadLetter, Job
from asyncwork.poll import POLL_SECONDS
from asyncwork.runner import backoff_seconds
from core.celery import app
from invoicing.tasks import EMAIL_QUEUE, resend_invoice_email, send_invoice_email
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import poison_job_dead_lettered, worker_env, worker_thread

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("email_task", [send_invoice_email, resend_invoice_email])
def test_the_email_tasks_run_on_the_policy_their_settings_give(email_task: Any) -> None:
    assert isinstance(email_task, ReliableTask)
    assert (
        email_task.max_attempts,
        email_task.backoff,
        email_task.backoff_max,
        email_task.time_limit,
        email_task.queue_name,
    ) == (
        settings.EMAIL_MAX_ATTEMPTS,
        settings.EMAIL_RETRY_BACKOFF_BASE,
        settings.EMAIL_RETRY_BACKOFF_MAX,
        settings.EMAIL_TASK_SOFT_TIME_LIMIT,
        EMAIL_QUEUE,
    )
    # Acknowledged once its outcome is written, requeued if the process running it is killed.
    runner = app.tasks[RUN]
    assert (runner.acks_late, runner.reject_on_worker_lost) == (True, True)

    result = email_task.enqueue(0)  # published at once: no transaction is open, no worker reads

    [message] = broker.queue_messages(EMAIL_QUEUE)
    headers = message["headers"]
    assert (headers["task"], headers["id"], headers["shadow"]) == (
        RUN,
        message_id(int(result.id)),
        email_task.module_path,
    )
    soft = settings.EMAIL_TASK_SOFT_TIME_LIMIT
    assert headers["timelimit"] == [soft + TIME_LIMIT_GRACE, soft]


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6])
def test_the_waits_double_up_to_the_maximum_each_drawn_at_random_below_it(attempt: int) -> None:
    """Full jitter: before run n + 1, anything from 0 to ``min(backoff_max, backoff * 2 **
    (n - 1))``, here 2, 4, 8, 16, 20, 20 s."""
    cap = min(20, 2 * 2 ** (attempt - 1))
    waits = [backoff_seconds(attempt=attempt, backoff=2, backoff_max=20) for _ in range(2000)]
    assert 0 <= min(waits) < 0.05 * cap  # from the start of the range
    assert 0.95 * cap < max(waits) <= cap  # to its end
    assert 0.4 * cap < sum(waits) / len(waits) < 0.6 * cap  # spread evenly (its mean is half)


@pytest.mark.parametrize(
    "given",
    [
        {"max_attempts": 0},
        {"backoff": 0},
        {"backoff": 10, "backoff_max": 5},
        {"time_limit": 0},
    ],
)
def test_a_policy_that_cannot_run_is_refused_where_the_task_is_declared(
    given: dict[str, Any],
) -> None:
    with pytest.raises(InvalidTaskError, match=r"(max_attempts >= 1|time_limit must be)"):
        task(**given)(declared_here)


def declared_here() -> None:
    """A task body for the declarations above (a task must be a module's own function)."""


def test_a_transient_failure_is_retried_on_the_tasks_policy() -> None:
    """``tests.flaky_soon``: two attempts, its retry within ``SOON_RETRY_SECONDS`` (its backoff
    and its longest wait), each error kept on the job."""
    key = f"flaky-{uuid.uuid4().hex}"
    with worker_thread(concurrency=1):
        result = test_tasks.flaky_soon.enqueue(key)
        assert wait_until(lambda: cache.get(key) == 2, timeout=test_tasks.SOON_RETRY_SECONDS + 10)
    done = test_tasks.flaky_soon.get_result(result.id)
    assert (str(done.status), done.attempts) == ("SUCCESSFUL", 2)
    assert [error.exception_class_path for error in done.errors] == [
        "asyncwork.errors.TransientError"
    ]
    assert "the first attempt fails" in done.errors[0].traceback
    job = Job.objects.get(pk=result.id)
    assert job.first_failed_at is not None
    assert job.last_attempted_at is not None
    waited = (job.last_attempted_at - job.first_failed_at).total_seconds()
    assert 0 <= waited < test_tasks.SOON_RETRY_SECONDS + POLL_SECONDS + 1
    assert not DeadLetter.objects.exists()


class Kept(logging.Handler):
    """Keeps the records of the logger it is added to (the worker's start reconfigures the root
    logger from Django's LOGGING, dropping pytest's own handler there)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_bug_fails_at_once_with_its_traceback() -> None:
    """``tests.divide`` by zero: an exception no task declares is a bug, and a retry would only
    meet it again: one attempt of five, a dead letter, an ERROR line with the traceback."""
    kept, logger = Kept(), logging.getLogger("asyncwork.deadletters")
    logger.addHandler(kept)
    try:
        with worker_thread():
            result = test_tasks.divide.enqueue(1, 0)
            assert wait_until(DeadLetter.objects.exists, timeout=20)
    finally:
        logger.removeHandler(kept)
    done = test_tasks.divide.get_result(result.id)
    assert (str(done.status), done.attempts) == ("FAILED", 1)
    assert isinstance(test_tasks.divide, ReliableTask)
    assert test_tasks.divide.max_attempts == 5
    [error] = done.errors
    assert error.exception_class_path == "builtins.ZeroDivisionError"
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.task_id, letter.reason, letter.attempts) == (
        test_tasks.divide.module_path,
        message_id(int(result.id)),
        "permanent",
        1,
    )
    assert letter.exception_class == "builtins.ZeroDivisionError"
    assert "ZeroDivisionError" in letter.traceback
    [line] = [r for r in kept.records if r.getMessage().startswith("job dead-lettered")]
    assert line.exc_info is not None
    assert line.exc_info[0] is ZeroDivisionError


@pytest.mark.slow
def test_a_job_that_kills_its_worker_every_time_fails_as_redelivery_limit(
    smtp_unreachable: int,
) -> None:
    """On Redis; on RabbitMQ, ``tests/asyncwork/test_rabbitmq.py``."""
    poison_job_dead_lettered(smtp_unreachable)


@pytest.mark.slow
def test_a_run_cut_by_its_soft_time_limit_is_retried() -> None:
    """``tests.backend_pid`` with a query of 5 s and a soft time limit of 1 s (its own): the
    limit interrupts the query, and the run is retried as a transient failure, not failed."""
    key = f"limited-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    worker = launch.celery_worker(
        worker_env(0), name="limited", include=("tests.tasks",), concurrency=1
    )
    try:
        worker.wait_ready()
        result = test_tasks.backend_pid.enqueue(key, sleep=5)
        job = Job.objects.filter(pk=result.id)
        retried = wait_until(lambda: job.get().attempts >= 2, timeout=30)
        log = worker.log_text()
    finally:
        worker.stop()
    assert retried, log[-3000:]
    errors = job.get().errors
    assert errors
    assert all(e["exception_class_path"].endswith(".SoftTimeLimitExceeded") for e in errors)
    assert "job failed (attempt 1 of 5), retried in" in log
    assert cache.get(key) is None  # never ran to its end
    assert not DeadLetter.objects.exists()
