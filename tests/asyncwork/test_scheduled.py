"""A retry waits in PostgreSQL, not in a worker nor in the broker (asyncwork.runner,
asyncwork.backend): the job's row made READY again, due after its wait, and published by a
worker's poll once due. Nothing is held in the broker meanwhile, so a worker that dies or a
broker that restarts takes no waiting retry with it (on Redis a held message would come back only
after the visibility timeout, or never after a restart), and RabbitMQ's consumer timeout cannot
cut in however long the wait. ``run_after`` waits the same way. A retry the database refuses to
record is not lost. On both brokers.

The retries here are ``tests.tasks.flaky``'s: due exactly ``FLAKY_RETRY_SECONDS`` after the first
attempt failed, where full jitter would make the wait anything up to the policy's."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from django.core.cache import cache
from django.db import connection
from django.utils import timezone
from psycopg import sql

from asyncwork import backend
from asyncwork.backend import RUN, TIME_LIMIT_GRACE, ReliableTask, message_id
from asyncwork.broker import ahead
from asyncwork.models import DeadLetter, Job
from asyncwork.poll import POLL_SECONDS
from asyncwork.runner import WRITE_WAIT
from core.celery import app
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env, worker_thread
from tests.helpers.redis_server import PrivateRedis

pytestmark = pytest.mark.django_db(transaction=True)

INCLUDE = ("tests.tasks",)


def waiting_retry(job_id: str) -> Job | None:
    """The job once its first attempt failed and its retry waits, unpublished; else None."""
    return Job.objects.filter(
        pk=job_id, status=Job.Status.READY, attempts=1, published_at__isnull=True
    ).first()


@pytest.mark.slow
def test_a_retry_waits_as_a_job_row_with_nothing_held_in_the_broker() -> None:
    key = f"asked-{uuid.uuid4().hex}"
    with worker_thread(concurrency=1):
        started = time.monotonic()
        result = test_tasks.flaky.enqueue(key)
        assert wait_until(lambda: waiting_retry(result.id) is not None, timeout=10)
        row = waiting_retry(result.id)
        assert row is not None
        assert row.due_at is not None
        assert row.last_attempted_at is not None
        assert (row.task, row.args) == (test_tasks.flaky.module_path, [key])
        assert [e["exception_class_path"] for e in row.errors] == [
            "asyncwork.errors.TransientError"
        ]
        assert row.first_failed_at is not None
        # Due the wait after the failed run (which took well under a second).
        wait = (row.due_at - row.last_attempted_at).total_seconds()
        assert test_tasks.FLAKY_RETRY_SECONDS <= wait < test_tasks.FLAKY_RETRY_SECONDS + 1

        # The first attempt's message is acknowledged; nothing waits in the broker.
        assert wait_until(lambda: broker.jobs_in_broker() == {}, timeout=5)
        if broker.RABBITMQ:  # nor in Celery's delay queues
            found = broker.rabbitmq_queues()
            delayed = [found.get(name, {}).get("messages_ready") for name in broker.DELAY_QUEUES]
            assert not any(delayed)
        assert cache.get(key) is None
        row.refresh_from_db()
        assert row.published_at is None  # still waiting in PostgreSQL

        # Published once due, by the worker's poll; it runs as the retry it is.
        assert wait_until(lambda: cache.get(key) == 2, timeout=test_tasks.FLAKY_RETRY_SECONDS + 10)
        took = time.monotonic() - started
    assert took >= test_tasks.FLAKY_RETRY_SECONDS
    row.refresh_from_db()
    assert (row.status, row.attempts) == (Job.Status.SUCCESSFUL, 2)
    assert row.published_at is not None
    assert row.last_attempted_at is not None
    assert row.last_attempted_at >= row.due_at  # not run before it was due
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
def test_a_job_run_after_a_time_waits_for_it_then_retries_from_the_queue_it_went_to() -> None:
    """``run_after`` waits in PostgreSQL too: nothing is published before the time. Due, the job
    runs, and its retry after it; its row keeps its queue, whichever queue its messages went to
    (the one read ahead of it: below)."""
    key = f"later-{uuid.uuid4().hex}"
    later = timezone.now() + timedelta(seconds=2)
    result = test_tasks.flaky.using(run_after=later).enqueue(key)
    job = Job.objects.get(pk=result.id)
    assert (job.due_at, job.published_at) == (later, None)
    assert broker.jobs_in_broker() == {}
    assert backend.relay() == 0  # not due

    with worker_thread(concurrency=1):
        assert wait_until(lambda: cache.get(key) == 2, timeout=test_tasks.FLAKY_RETRY_SECONDS + 15)
    job.refresh_from_db()
    assert job.queue == test_tasks.flaky.queue_name
    assert (job.status, job.attempts) == (Job.Status.SUCCESSFUL, 2)
    assert job.started_at is not None
    assert job.started_at >= later
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
def test_a_retry_outlives_the_worker_that_scheduled_it() -> None:
    """The worker is killed (SIGKILL, parent included) while its retry waits; another worker
    runs the retry at its due time, not after the visibility timeout (20 s here)."""
    key = f"asked-{uuid.uuid4().hex}"
    env = worker_env(0, SCALED, **SCALED_BREAKER)
    first = launch.celery_worker(env, name="doomed", include=INCLUDE)
    second = None
    try:
        first.wait_ready()
        started = time.monotonic()
        result = test_tasks.flaky.enqueue(key)
        assert wait_until(lambda: waiting_retry(result.id) is not None, timeout=15)
        assert wait_until(lambda: "retried in" in first.log_text(), timeout=5)
        first.kill()
        assert waiting_retry(result.id) is not None
        second = launch.celery_worker(env, name="survivor", include=INCLUDE)
        second.wait_ready()
        assert wait_until(lambda: cache.get(key) == 2, timeout=30)
        took = time.monotonic() - started
    finally:
        for worker in (first, second):
            if worker is not None:
                worker.stop()
    assert took < test_tasks.FLAKY_RETRY_SECONDS + 5 < int(SCALED["TEST_VISIBILITY_TIMEOUT"])
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
@broker.redis_only  # RabbitMQ's queues are durable: tests/invoicing/test_rabbitmq_node.py
def test_a_retry_outlives_a_broker_restart(private_redis: PrivateRedis) -> None:
    """The broker (a Redis of the test's own, nothing on disk) restarts while a retry waits:
    the retry runs at its due time. (A retry held in the broker, or by the worker as a message
    with an ETA, would be dropped by the restart.) The job is enqueued due at once, so the
    worker's poll publishes it, to the worker's broker."""
    key = f"asked-{uuid.uuid4().hex}"
    env = worker_env(0, SCALED, CELERY_BROKER_URL=private_redis.url, **SCALED_BREAKER)
    worker = launch.celery_worker(env, name="restarted-broker", include=INCLUDE)
    try:
        worker.wait_ready()
        started = time.monotonic()
        result = test_tasks.flaky.using(run_after=timezone.now()).enqueue(key)
        assert wait_until(lambda: waiting_retry(result.id) is not None, timeout=15)
        private_redis.shutdown_nosave()
        private_redis.start()
        ran = wait_until(lambda: cache.get(key) == 2, timeout=30)
        took = time.monotonic() - started
        log = worker.log_text()
    finally:
        worker.stop()
    assert ran, log[-3000:]
    assert took < test_tasks.FLAKY_RETRY_SECONDS + 5
    assert not DeadLetter.objects.exists()


@contextlib.contextmanager
def database_down() -> Iterator[None]:
    """The test database as a PostgreSQL restart leaves it to every other process: their
    connections cut, new ones refused, until the block ends. This test's own connection
    stays (the test reads through it, and the run's teardown needs it)."""
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (own,) = cursor.fetchone()
    db = connection.settings_dict
    admin = psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", autocommit=True
    )
    try:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(name))
        )
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> %s",
            [name, own],
        )
        yield
    finally:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(sql.Identifier(name))
        )
        admin.close()


def outage_run(*, down_for: float) -> tuple[Job, str, float]:
    """``tests.outage`` in a worker process whose first run fails while the database is down for
    ``down_for`` seconds; the job once its retry ran, the worker's log, and the seconds from the
    end of the outage to the retry's end."""
    key = f"outage-{uuid.uuid4().hex}"
    cache.set(f"{key}:runs", 0, timeout=300)
    worker = launch.celery_worker(
        worker_env(0, SCALED), name="outage", include=("tests.tasks",), concurrency=1
    )
    try:
        worker.wait_ready()
        result = test_tasks.outage.enqueue(key)
        assert wait_until(lambda: cache.get(f"{key}:runs") == 1, timeout=15)
        with database_down():
            cache.set(f"{key}:go", 1, timeout=300)  # the first run fails now
            time.sleep(down_for)
        back = time.monotonic()
        ran = wait_until(lambda: cache.get(key) == 2, timeout=90)
        took = time.monotonic() - back
        log = worker.log_text()
    finally:
        worker.stop()
    assert ran, log[-3000:]
    assert cache.get(f"{key}:runs") == 2  # the failed attempt, then its retry
    return Job.objects.get(pk=result.id), log, took


@pytest.mark.slow
def test_a_retry_written_while_the_database_restarts_waits_out_the_outage() -> None:
    """PostgreSQL is down for 3 s when a job's retry must be written: the worker writes it
    again each second until the database is back, and the retry runs as usual."""
    job, log, took = outage_run(down_for=3)
    assert (job.status, job.attempts) == (Job.Status.SUCCESSFUL, 2)
    assert [e["exception_class_path"] for e in job.errors] == ["asyncwork.errors.TransientError"]
    assert "not recorded" not in log
    assert took < 10
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
def test_a_retry_the_database_refuses_is_given_back_by_the_runs_lease_and_not_lost() -> None:
    """PostgreSQL is down longer than the worker waits to record the run's outcome
    (``WRITE_WAIT``): nothing is recorded, the job stays RUNNING under its lease (the task's
    hard time limit and a margin), and once that expires the workers' rescue makes it READY
    again: it runs, the lost run counted as an attempt, and no dead letter."""
    job, log, took = outage_run(down_for=WRITE_WAIT + 2)
    assert "its next run not recorded" in log
    assert "its lease will give it back" in log
    assert "rescue jobs: 1 job(s)" in log
    assert (job.status, job.attempts) == (Job.Status.SUCCESSFUL, 2)
    assert job.errors == []  # the failed run's error was never recorded
    # The lease: the task's hard time limit (Celery's, scaled) and its margin, from the claim.
    assert took < int(SCALED["CELERY_TASK_TIME_LIMIT"]) + 30 + 10
    assert not DeadLetter.objects.exists()


def scheduled(due_in: float) -> Job:
    return backend.job_create(
        task=test_tasks.pid.module_path,
        args=[f"pid-{uuid.uuid4().hex}"],
        kwargs={},
        queue=test_tasks.pid.queue_name,
        due_at=timezone.now() + timedelta(seconds=due_in),
    )


def test_nothing_publishes_a_job_before_it_is_due() -> None:
    later = scheduled(due_in=3600)
    due = scheduled(due_in=0)
    Job.objects.filter(pk__in=[later.pk, due.pk]).update(
        created_at=timezone.now() - timedelta(hours=1)
    )
    # The relay, however old the rows: only the job that came due.
    assert backend.relay(grace=timedelta(0)) == 1
    later.refresh_from_db()
    due.refresh_from_db()
    assert later.published_at is None
    assert due.published_at is not None
    assert backend.relay(grace=timedelta(0)) == 0
    Job.objects.filter(pk=later.pk).update(due_at=timezone.now())
    assert backend.relay(grace=timedelta(0)) == 1


def test_a_job_come_due_is_published_as_its_id_to_the_queue_read_ahead_of_its_own() -> None:
    """The message names the job alone (the runner reads the rest from the row), under the
    job's message id, shown as its task, with its task's time limits; a task without any has
    none in its message, so the worker's own defaults apply, not the publisher's."""
    assert app.tasks[RUN].time_limit is not None  # this process's default, on the runner task
    key = f"overrun-{uuid.uuid4().hex}"
    result = test_tasks.overrun.using(run_after=timezone.now()).enqueue(key)
    unlimited = test_tasks.pid.using(run_after=timezone.now()).enqueue(key)
    assert backend.relay() == 2
    again = ahead(test_tasks.overrun.queue_name)
    published = {m["headers"]["id"]: m["headers"] for m in broker.queue_messages(again)}
    assert published[message_id(int(unlimited.id))]["timelimit"] == [None, None]
    headers = published[message_id(int(result.id))]
    assert (headers["task"], headers["id"], headers["shadow"]) == (
        RUN,
        message_id(int(result.id)),
        test_tasks.overrun.module_path,
    )
    assert headers["argsrepr"] == repr([int(result.id)])
    assert isinstance(test_tasks.overrun, ReliableTask)
    limit = test_tasks.overrun.time_limit
    assert limit is not None
    assert headers["timelimit"] == [limit + TIME_LIMIT_GRACE, limit]
    broker.queues_empty()


def test_the_poll_publishes_what_came_due_within_its_interval() -> None:
    """A worker's poll alone, no job of any other process: a job come due is published within
    ``POLL_SECONDS`` of its due time (and a tick), and run."""
    key = f"pid-{uuid.uuid4().hex}"
    with worker_thread(concurrency=1):
        due = timezone.now() + timedelta(seconds=2)
        result = test_tasks.pid.using(run_after=due).enqueue(key)
        assert wait_until(lambda: cache.get(key) is not None, timeout=10)
    job = Job.objects.get(pk=result.id)
    assert job.published_at is not None
    late = (job.published_at - due).total_seconds()
    assert 0 <= late < POLL_SECONDS + 1
