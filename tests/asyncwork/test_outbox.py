"""The outbox: a stalled broker never fails or hangs the request; a worker's poll, alone,
publishes within seconds what a publish at commit left behind (``backend.relay``, on its poll
thread: no other process, command nor scheduled job); a job published twice runs once; and
concurrent relays never publish one row twice."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import connection
from django.test import Client

from asyncwork import backend
from asyncwork.backend import _producer_drop
from asyncwork.broker import ahead
from asyncwork.models import Job
from asyncwork.poll import POLL_SECONDS
from asyncwork.settings import asyncwork_settings
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.redis_server import PrivateRedis
from tests.helpers.stripe import paid_event, post_event

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stallable_broker(
    private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> Any:
    """The broker is a Redis of this test's own, which it may stall: the machine's is shared.
    Publishes (this thread's kept outbox connection), the worker and the test's reads of the
    broker (``tests.helpers.broker``) go there."""
    from core.celery import app

    # Celery reads the environment's CELERY_BROKER_URL before its own setting.
    monkeypatch.setenv("CELERY_BROKER_URL", private_redis.url)
    monkeypatch.setattr(app.conf, "broker_url", private_redis.url)
    settings.CELERY_BROKER_URL = private_redis.url
    _producer_drop()
    yield private_redis.client()
    _producer_drop()


@broker.redis_only  # a shared RabbitMQ node cannot be stalled for one test
@pytest.mark.slow
def test_stalled_broker_at_commit_leaves_the_job_to_a_workers_poll(
    client: Client, smtp: SmtpServer, stallable_broker: redis.Redis
) -> None:
    body = stripe_events.encode(paid_event())
    stallable_broker.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # the broker stalls
    started = time.monotonic()
    response = post_event(client, body)
    elapsed = time.monotonic() - started

    assert response.status_code == 200
    assert elapsed < asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT + 1.0
    row = Job.objects.get()
    assert row.published_at is None
    assert row.publish_attempts == 1
    assert "imeout" in row.last_error

    time.sleep(2.6)  # the stall ends
    with worker_thread():
        started = time.monotonic()
        assert wait_until(
            lambda: Job.objects.filter(pk=row.pk, published_at__isnull=False).exists(), timeout=10
        )
        took = time.monotonic() - started
        smtp.handler.wait_for(1, timeout=20)
        pipeline_quiet()
    # Within a poll or two of the worker's start (the tests' grace is 0 s).
    assert took < 2 * POLL_SECONDS + 1
    row.refresh_from_db()
    assert (row.status, row.attempts, row.publish_attempts) == (Job.Status.SUCCESSFUL, 1, 2)
    assert len(smtp.messages) == 1


def test_a_publisher_killed_between_publish_and_mark_publishes_again_and_one_email_is_sent(
    client: Client, smtp: SmtpServer
) -> None:
    """The state a crash after publishing but before marking the row leaves behind: the message
    went out, the row is still unpublished; the relay publishes it again. Both messages wait for
    the worker, which runs the job once (its claim): one run, one email."""
    assert post_event(client, stripe_events.encode(paid_event())).status_code == 200
    row = Job.objects.get()
    assert row.published_at is not None
    Job.objects.filter(pk=row.pk).update(published_at=None)  # the mark, lost
    assert backend.relay() == 1
    assert sum(broker.jobs_in_broker().values()) == 2
    with worker_thread():
        smtp.handler.wait_for(1, timeout=20)
        pipeline_quiet()
    row.refresh_from_db()
    assert (row.status, row.attempts, len(row.worker_ids)) == (Job.Status.SUCCESSFUL, 1, 1)
    assert len(smtp.messages) == 1


def test_concurrent_relays_publish_each_row_exactly_once() -> None:
    queue = f"relaytest-{uuid.uuid4().hex[:8]}"
    Job.objects.bulk_create(
        Job(task="core.does_not_exist", args=[i], queue=queue) for i in range(300)
    )
    barrier = threading.Barrier(4)
    totals: list[int] = []

    def relay() -> None:
        try:
            barrier.wait()
            totals.append(backend.relay(grace=timedelta(0), batch_size=25))
        finally:
            connection.close()

    threads = [threading.Thread(target=relay) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Published late: to the queue read ahead of the job's own.
    task_ids = [m["headers"]["id"] for m in broker.queue_messages(ahead(queue))]
    broker.queue_delete(ahead(queue))
    assert sum(totals) == 300
    assert len(task_ids) == 300
    assert set(task_ids) == {
        backend.message_id(pk) for pk in Job.objects.values_list("pk", flat=True)
    }
    assert not Job.objects.filter(published_at__isnull=True).exists()


def test_relay_leaves_young_rows_to_their_own_publish() -> None:
    Job.objects.create(task="core.does_not_exist", args=[1], queue="relaytest-young")
    assert backend.relay(grace=timedelta(seconds=60)) == 0
    assert Job.objects.get().published_at is None


# Fails every mark (an UPDATE that sets published_at) while it exists.
REFUSE_MARKS = """
CREATE FUNCTION outbox_marks_refused() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'marks refused by the test'; END $$;
CREATE TRIGGER outbox_marks_refused BEFORE UPDATE OF published_at ON asyncwork_job
FOR EACH ROW EXECUTE FUNCTION outbox_marks_refused();
"""
ALLOW_MARKS = """
DROP TRIGGER IF EXISTS outbox_marks_refused ON asyncwork_job;
DROP FUNCTION IF EXISTS outbox_marks_refused();
"""


def test_a_mark_the_database_refuses_fails_no_request_and_leaves_the_row_to_the_relay(
    client: Client, smtp: SmtpServer
) -> None:
    """The mark after an on-commit publish fails (the database gone since the commit): the
    request still answers 200, and the job, left unpublished, is published again by the relay:
    a second message, never a lost one, one run and one email."""
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_MARKS)
    try:
        assert post_event(client, stripe_events.encode(paid_event())).status_code == 200
        row = Job.objects.get()
        assert (row.published_at, row.publish_attempts) == (None, 0)
        assert sum(broker.jobs_in_broker().values()) == 1  # it went out all the same
    finally:
        with connection.cursor() as cursor:
            cursor.execute(ALLOW_MARKS)
    assert backend.relay() == 1
    row.refresh_from_db()
    assert row.published_at is not None
    with worker_thread():
        smtp.handler.wait_for(1, timeout=20)
        # Both messages consumed (the second finds the job run) before counting emails.
        pipeline_quiet()
    row.refresh_from_db()
    assert (row.status, row.attempts) == (Job.Status.SUCCESSFUL, 1)
    assert len(smtp.messages) == 1
