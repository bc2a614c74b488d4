"""A retry waits in PostgreSQL, not in a worker nor in the broker (asyncwork.tasks,
asyncwork.scheduled): an outbox row due after its countdown, published by a worker's poll once
due. Nothing is held in the broker meanwhile, so a worker that dies or a broker that restarts
takes no waiting retry with it (on Redis a held message would come back only after the
visibility timeout, or never after a restart), and RabbitMQ's consumer timeout cannot cut in
however long the wait. A retry the database refuses goes back to its queue. On both brokers.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from asyncwork.tasks import RETRY_WRITE_WAIT
from django.core.cache import cache
from django.db import connection
from django.utils import timezone
from psycopg import sql

from asyncwork import queues
from asyncwork.models import DeadLetter, OutboxMessage
from asyncwork.outbox import outbox_publish_due, outbox_relay, outbox_schedule
from core.celery import app
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env, worker_thread
from tests.helpers.redis_server import PrivateRedis

pytestmark = pytest.mark.django_db(transaction=True)


def _waiting_retry(task_id: str) -> OutboxMessage | None:
    return OutboxMessage.objects.filter(task_id=task_id, published_at__isnull=True).first()


@pytest.mark.slow
def test_a_retry_waits_as_an_outbox_row_with_nothing_held_in_the_broker() -> None:
    key = f"flaky-{uuid.uuid4().hex}"
    with worker_thread(concurrency=1):
        started = time.monotonic()
        task_id = app.send_task(test_tasks.FLAKY, args=[key]).id
        assert wait_until(lambda: _waiting_retry(task_id) is not None, timeout=10)
        row = _waiting_retry(task_id)
        assert row is not None
        assert row.due_at is not None
        assert row.task == test_tasks.FLAKY
        assert row.args == [key]
        assert row.headers["retries"] == 1
        assert "first_failed_at" in row.headers
        wait = (row.due_at - row.created_at).total_seconds()
        assert test_tasks.FLAKY_RETRY_SECONDS - 1 < wait < test_tasks.FLAKY_RETRY_SECONDS + 1

        # The first attempt's message is acknowledged; nothing waits in the broker.
        consumed = [queue.name for queue in queues.consumed()]
        assert wait_until(lambda: broker.held_unacknowledged() == 0, timeout=5)
        assert [broker.queue_depth(name) for name in consumed] == [0] * len(consumed)
        if broker.RABBITMQ:  # nor in Celery's delay queues
            found = broker.rabbitmq_queues()
            delayed = [found.get(name, {}).get("messages_ready") for name in broker.DELAY_QUEUES]
            assert not any(delayed)
        assert cache.get(key) is None

        # Published once due, by the worker's poll; it runs as the retry it is.
        assert wait_until(lambda: cache.get(key) == 2, timeout=test_tasks.FLAKY_RETRY_SECONDS + 10)
        took = time.monotonic() - started
    assert took >= test_tasks.FLAKY_RETRY_SECONDS - 1
    row.refresh_from_db()
    assert row.published_at is not None
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
def test_a_job_delivered_after_a_delay_retries_onto_its_own_queue() -> None:
    """A job first sent with a countdown, then failing: its retry waits for the job's own queue
    and runs. On RabbitMQ the delayed message comes through Celery's delay exchanges, and its
    routing key is the delay's bits before the queue's name: taken as the queue, it named one
    nobody reads, and the retry was published into it, confirmed and never run."""
    key = f"flaky-{uuid.uuid4().hex}"
    with worker_thread(concurrency=1):
        task_id = app.send_task(test_tasks.FLAKY, args=[key], countdown=1).id
        assert wait_until(lambda: _waiting_retry(task_id) is not None, timeout=15)
        row = _waiting_retry(task_id)
        assert row is not None
        assert row.queue == queues.queue_ahead(queues.queue_for(test_tasks.FLAKY))
        assert wait_until(lambda: cache.get(key) == 2, timeout=test_tasks.FLAKY_RETRY_SECONDS + 15)


def test_the_queue_a_job_came_from_is_read_without_the_delay_bits() -> None:
    email = queues.consumed()[-1].name  # a queue of an app's, not the task's own
    assert email != queues.queue_for(test_tasks.FLAKY)
    delayed = ".".join("0" * 27 + "1") + f".{email}"
    came = {"exchange": "celery_delayed_27", "routing_key": delayed}
    assert queues.queue_delivered(came, test_tasks.FLAKY) == email
    assert queues.queue_delivered({"exchange": "", "routing_key": email}, test_tasks.FLAKY) == email
    # No queue of ours: the task's own.
    own = queues.queue_for(test_tasks.FLAKY)
    assert queues.queue_delivered({"routing_key": "elsewhere"}, test_tasks.FLAKY) == own
    assert queues.queue_delivered(None, test_tasks.FLAKY) == own


@pytest.mark.slow
def test_a_retry_outlives_the_worker_that_scheduled_it() -> None:
    """The worker is killed (SIGKILL, parent included) while its retry waits; another worker
    runs the retry at its due time, not after the visibility timeout (20 s here)."""
    key = f"flaky-{uuid.uuid4().hex}"
    env = worker_env(0, SCALED, **SCALED_BREAKER)
    first = launch.celery_worker(env, name="doomed", include=("tests.tasks",))
    second = None
    try:
        first.wait_ready()
        started = time.monotonic()
        task_id = app.send_task(test_tasks.FLAKY, args=[key]).id
        assert wait_until(lambda: f"[{task_id}] retry" in first.log_text(), timeout=15)
        first.kill()
        assert _waiting_retry(task_id) is not None
        second = launch.celery_worker(env, name="survivor", include=("tests.tasks",))
        second.wait_ready()
        assert wait_until(lambda: cache.get(key) == 2, timeout=30)
        took = time.monotonic() - started
    finally:
        for worker in (first, second):
            if worker is not None:
                worker.stop()
    assert took < test_tasks.FLAKY_RETRY_SECONDS + 5 < int(SCALED["CELERY_VISIBILITY_TIMEOUT"])
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
@broker.redis_only  # RabbitMQ's queues are durable: tests/invoicing/test_rabbitmq_node.py
def test_a_retry_outlives_a_broker_restart(private_redis: PrivateRedis) -> None:
    """The broker (a Redis of the test's own, nothing on disk) restarts while a retry waits:
    the retry runs at its due time. (A retry held by the worker as a message with an ETA is
    dropped from the worker's timer with the lost connection, and from Redis by the restart.)"""
    key = f"flaky-{uuid.uuid4().hex}"
    env = worker_env(0, SCALED, CELERY_BROKER_URL=private_redis.url, **SCALED_BREAKER)
    worker = launch.celery_worker(env, name="restarted-broker", include=("tests.tasks",))
    try:
        worker.wait_ready()
        started = time.monotonic()
        with app.connection_for_write(private_redis.url) as conn:
            task_id = app.send_task(test_tasks.FLAKY, args=[key], connection=conn).id
        assert wait_until(lambda: _waiting_retry(task_id) is not None, timeout=15)
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


@pytest.mark.slow
def test_a_retry_the_database_refuses_goes_back_to_its_queue_and_is_not_lost() -> None:
    """PostgreSQL is down when a job's retry must be written: the worker tries again for
    ``RETRY_WRITE_WAIT`` seconds, then gives the message back to its queue unchanged (no
    attempt spent). Its next delivery fails again, writes its retry once the database is back,
    and the retry runs: one attempt more than without the outage's runs, no dead letter."""
    key = f"outage-{uuid.uuid4().hex}"
    cache.set(f"{key}:runs", 0, timeout=300)
    worker = launch.celery_worker(
        worker_env(0), name="outage", include=("tests.tasks",), concurrency=1
    )
    try:
        worker.wait_ready()
        task_id = app.send_task(test_tasks.OUTAGE, args=[key]).id
        assert wait_until(lambda: cache.get(f"{key}:runs") == 1, timeout=15)
        with database_down():
            cache.set(f"{key}:go", 1, timeout=300)  # the first run fails now
            requeued = wait_until(
                lambda: "goes back to its queue" in worker.log_text(),
                timeout=RETRY_WRITE_WAIT + 10,
            )
            # The next delivery runs at once, and waits for the database in its turn.
            again = wait_until(lambda: cache.get(f"{key}:runs") == 2, timeout=10)
            time.sleep(2)  # the outage goes on while that delivery waits for the database
        ran = wait_until(lambda: cache.get(key) == 2, timeout=30)
        log = worker.log_text()
    finally:
        worker.stop()
    assert requeued, log[-3000:]
    assert again, log[-3000:]
    assert ran, log[-3000:]
    assert log.count("goes back to its queue") == 1
    assert cache.get(f"{key}:runs") == 3  # the first attempt twice, then its retry
    row = OutboxMessage.objects.get(task_id=task_id)
    assert row.headers["retries"] == 1  # the requeue spent no attempt
    assert row.published_at is not None
    assert not DeadLetter.objects.exists()


def _scheduled(due_in: float) -> OutboxMessage:
    return outbox_schedule(
        task=test_tasks.PID,
        args=[f"pid-{uuid.uuid4().hex}"],
        kwargs={},
        queue=queues.queue_for(test_tasks.PID),
        due_in=due_in,
        task_id=f"retry-{uuid.uuid4().hex}",
        headers={"retries": 2, "first_failed_at": timezone.now().isoformat()},
    )


def test_nothing_publishes_a_row_before_it_is_due() -> None:
    later = _scheduled(due_in=3600)
    due = _scheduled(due_in=0)
    OutboxMessage.objects.filter(pk=due.pk).update(created_at=timezone.now() - timedelta(hours=1))
    # The relay, however old the rows, and the poll: only the row that came due.
    assert outbox_relay(grace=timedelta(0)) == 1
    assert outbox_publish_due() == 0
    later.refresh_from_db()
    due.refresh_from_db()
    assert later.published_at is None
    assert due.published_at is not None
    OutboxMessage.objects.filter(pk=later.pk).update(due_at=timezone.now())
    assert outbox_publish_due() == 1


def test_a_published_retry_carries_its_task_id_retry_count_and_headers() -> None:
    row = _scheduled(due_in=0)
    assert outbox_publish_due() == 1
    (message,) = broker.queue_messages(row.queue)
    headers = message["headers"]
    assert headers["id"] == row.task_id
    assert headers["task"] == test_tasks.PID
    assert headers["retries"] == 2
    assert headers["first_failed_at"] == row.headers["first_failed_at"]
    broker.queues_empty()
