"""Tasks that exist only for tests, loaded into a worker process with ``-I tests.tasks``
(``WorkerProcess(include=...)``): jobs of the project's own task class that fail in ways the
project's tasks do not, on demand."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from asyncwork.tasks import ReliableTask, RetryPolicy, reliable_task
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.core.cache import cache
from django.db import connection

from asyncwork.contrib.periodic.jobs import JobTask, job_run
from asyncwork.errors import TransientError

DIVIDE = "tests.divide"
CRASH = "tests.crash"
FLAKY = "tests.flaky"
FLAKY_RETRY_SECONDS = 8
OUTAGE = "tests.outage"
FAILING_JOB = "tests-failing-job"
BACKEND_PID = "tests.backend_pid"


@reliable_task(name=DIVIDE)
def divide(self: ReliableTask, numerator: int, denominator: int) -> float:
    """A bug waiting for its input: ``denominator=0`` raises ZeroDivisionError, an exception
    class no task declares (neither permanent nor transient)."""
    return numerator / denominator


@shared_task(base=JobTask, name="tests.failing_job")
def failing_job() -> object:
    """A scheduled job whose body has a bug."""
    return job_run(name=FAILING_JOB, body=lambda: 1 / 0).result


@reliable_task(name=CRASH)
def crash(self: ReliableTask) -> None:
    """A poison message: kills the pool process running it, every time."""
    os.kill(os.getpid(), signal.SIGKILL)


@reliable_task(
    name=FLAKY,
    retry=RetryPolicy(
        attempts=2, backoff=FLAKY_RETRY_SECONDS, backoff_max=FLAKY_RETRY_SECONDS, jitter=False
    ),
)
def flaky(self: Any, key: str) -> None:
    """Fails its first attempt (transient: retried in ``FLAKY_RETRY_SECONDS``), then records in
    the cache under ``key`` the attempt that succeeded."""
    if self.request.retries == 0:
        raise TransientError("the first attempt fails")
    cache.set(key, self.request.retries + 1, timeout=300)


@reliable_task(name=OUTAGE, retry=RetryPolicy(attempts=2, backoff=1, backoff_max=1, jitter=False))
def outage(self: Any, key: str) -> None:
    """``flaky``, for a database outage timed by the test: counts its runs in the cache under
    ``<key>:runs`` (which the test sets to 0), and its first run fails only once ``<key>:go``
    is set (up to 30 s)."""
    if cache.incr(f"{key}:runs") == 1:
        deadline = time.monotonic() + 30
        while not cache.get(f"{key}:go") and time.monotonic() < deadline:
            time.sleep(0.1)
    if self.request.retries == 0:
        raise TransientError("the first attempt fails")
    cache.set(key, self.request.retries + 1, timeout=300)


PID = "tests.pid"
OVERRUN = "tests.overrun"


@reliable_task(name=PID)
def pid(self: ReliableTask, key: str) -> None:
    """Records in the cache under ``key`` the pid of the process that ran it."""
    cache.set(key, os.getpid(), timeout=300)


@reliable_task(name=OVERRUN, soft_time_limit=1, time_limit=10)
def overrun(self: ReliableTask, key: str) -> None:
    """Runs past its soft time limit (1 s) and records in the cache under ``key`` whether the
    limit interrupted it."""
    try:
        time.sleep(5)
    except SoftTimeLimitExceeded:
        cache.set(key, "interrupted", timeout=300)
    else:
        cache.set(key, "ran on", timeout=300)


NAP = "tests.nap"


@reliable_task(name=NAP)
def nap(self: ReliableTask, key: str, seconds: float) -> None:
    """Counts its runs in the cache under ``<key>:runs``, sleeps ``seconds``, then records
    under ``key`` the pid of the process that finished it."""
    cache.get_or_set(f"{key}:runs", 0, timeout=300)
    cache.incr(f"{key}:runs")
    time.sleep(seconds)
    cache.set(key, os.getpid(), timeout=300)


HOLD = "tests.hold"


@reliable_task(name=HOLD)
def hold(self: ReliableTask, key: str, seconds: float) -> None:
    """Keeps its message unacknowledged (acks late) for ``seconds`` on its first run, then
    counts in the cache under ``key`` every run after it: what RabbitMQ's consumer timeout
    cuts off."""
    if cache.add(key, 1, timeout=300):
        time.sleep(seconds)
    else:
        cache.incr(key)


@reliable_task(name=BACKEND_PID, soft_time_limit=1, time_limit=10)
def backend_pid(self: ReliableTask, key: str, sleep: float = 0) -> None:
    """Records in the cache under ``key`` the PostgreSQL backend serving this run's queries:
    which database connection the task ran on. With ``sleep``, a query of that many seconds
    comes first: past 1 s, its soft time limit interrupts the task in the middle of it, and
    nothing is recorded."""
    with connection.cursor() as cursor:
        if sleep:
            cursor.execute("SELECT pg_sleep(%s)", [sleep])
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    cache.set(key, pid, timeout=300)
