"""Tasks that exist only for tests, loaded into a worker process with ``-I tests.tasks``
(``WorkerProcess(include=...)``): tasks of the project's backend that fail in ways the project's
tasks do not, on demand. Each is Django's ``@task`` (asyncwork's backend); a task's own context
(``takes_context``) gives the attempt it runs."""

from __future__ import annotations

import os
import signal
import time

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.core.cache import cache
from django.db import connection
from django_tasks import TaskContext, task

from asyncwork.contrib.periodic.jobs import JobTask, job_run
from asyncwork.errors import TransientError

FLAKY_RETRY_SECONDS = 8
SOON_RETRY_SECONDS = 1
FAILING_JOB = "tests-failing-job"


@task
def divide(numerator: int, denominator: int) -> float:
    """A bug waiting for its input: ``denominator=0`` raises ZeroDivisionError, an exception
    class no task declares (neither permanent nor transient)."""
    return numerator / denominator


@shared_task(base=JobTask, name="tests.failing_job")
def failing_job() -> object:
    """A scheduled job whose body has a bug."""
    return job_run(name=FAILING_JOB, body=lambda: 1 / 0).result


@task(max_attempts=3)
def crash() -> None:
    """A poison job: kills the pool process running it, every time."""
    os.kill(os.getpid(), signal.SIGKILL)


@task(
    takes_context=True,
    max_attempts=2,
    backoff=FLAKY_RETRY_SECONDS,
    backoff_max=FLAKY_RETRY_SECONDS,
)
def flaky(context: TaskContext, key: str) -> None:
    """Fails its first attempt as a dependency that asks to be left alone
    ``FLAKY_RETRY_SECONDS`` (``retry_after``, as an HTTP 429's Retry-After), which is also the
    task's longest wait: its retry is due exactly that long after, not at a random time of full
    jitter (``asyncwork.runner``). Then records in the cache under ``key`` the attempt that
    succeeded."""
    _first_attempt_fails(context, key, retry_after=FLAKY_RETRY_SECONDS)


@task(
    takes_context=True,
    max_attempts=2,
    backoff=SOON_RETRY_SECONDS,
    backoff_max=SOON_RETRY_SECONDS,
)
def flaky_soon(context: TaskContext, key: str) -> None:
    """``flaky`` with a wait of ``SOON_RETRY_SECONDS``, for a test that proves the retry itself
    rather than how long it waits or what happens meanwhile."""
    _first_attempt_fails(context, key, retry_after=SOON_RETRY_SECONDS)


def _first_attempt_fails(context: TaskContext, key: str, *, retry_after: float) -> None:
    if context.attempt == 1:
        raise TransientError("the first attempt fails", retry_after=retry_after)
    cache.set(key, context.attempt, timeout=300)


@task(takes_context=True, max_attempts=2, backoff=1, backoff_max=1)
def outage(context: TaskContext, key: str) -> None:
    """``flaky``, for a database outage timed by the test: counts its runs in the cache under
    ``<key>:runs`` (which the test sets to 0), and its first run fails only once ``<key>:go``
    is set (up to 30 s)."""
    if cache.incr(f"{key}:runs") == 1:
        deadline = time.monotonic() + 30
        while not cache.get(f"{key}:go") and time.monotonic() < deadline:
            time.sleep(0.1)
    if context.attempt == 1:
        raise TransientError("the first attempt fails")
    cache.set(key, context.attempt, timeout=300)


@task
def pid(key: str) -> None:
    """Records in the cache under ``key`` the pid of the process that ran it."""
    cache.set(key, os.getpid(), timeout=300)


@task(time_limit=1)
def overrun(key: str) -> None:
    """Runs past its soft time limit (1 s) and records in the cache under ``key`` whether the
    limit interrupted it."""
    try:
        time.sleep(5)
    except SoftTimeLimitExceeded:
        cache.set(key, "interrupted", timeout=300)
    else:
        cache.set(key, "ran on", timeout=300)


@task
def nap(key: str, seconds: float) -> None:
    """Counts its runs in the cache under ``<key>:runs``, sleeps ``seconds``, then records
    under ``key`` the pid of the process that finished it."""
    cache.get_or_set(f"{key}:runs", 0, timeout=300)
    cache.incr(f"{key}:runs")
    time.sleep(seconds)
    cache.set(key, os.getpid(), timeout=300)


@task
def hold(key: str, seconds: float) -> None:
    """Keeps its message unacknowledged (acks late) for ``seconds`` on its first run, then
    counts in the cache under ``key`` every run after it: what RabbitMQ's consumer timeout
    cuts off."""
    if cache.add(key, 1, timeout=300):
        time.sleep(seconds)
    else:
        cache.incr(key)


@task(time_limit=1)
def backend_pid(key: str, sleep: float = 0) -> None:
    """Records in the cache under ``key`` the PostgreSQL backend serving this run's queries:
    which database connection the task ran on. With ``sleep``, a query of that many seconds
    comes first: past 1 s, its soft time limit interrupts the task in the middle of it, and
    nothing is recorded."""
    with connection.cursor() as cursor:
        if sleep:
            cursor.execute("SELECT pg_sleep(%s)", [sleep])
        cursor.execute("SELECT pg_backend_pid()")
        (backend,) = cursor.fetchone()
    cache.set(key, backend, timeout=300)
