"""The outbox: a stalled broker never fails or hangs the request, the relay publishes what was
left behind, and concurrent relays never publish one row twice."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.db import connection
from django.test import Client

from asyncwork.models import OutboxMessage
from asyncwork.outbox import _producer_drop, outbox_relay, outbox_task_id
from asyncwork.settings import asyncwork_settings
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.redis_server import PrivateRedis
from tests.helpers.stripe import paid_event, post_event
from webhooks import testing as stripe_testing

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
def test_stalled_broker_at_commit_leaves_the_row_for_the_relay(
    client: Client, smtp: SmtpServer, stallable_broker: redis.Redis
) -> None:
    body = stripe_testing.encode(paid_event())
    stallable_broker.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # the broker stalls
    started = time.monotonic()
    response = post_event(client, body)
    elapsed = time.monotonic() - started

    assert response.status_code == 200
    assert elapsed < asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT + 1.0
    row = OutboxMessage.objects.get()
    assert row.published_at is None
    assert row.publish_attempts == 1
    assert "imeout" in row.last_error

    time.sleep(2.6)  # the stall ends
    with worker_thread():
        call_command("outbox", "relay", "--grace", "0")
        smtp.handler.wait_for(1, timeout=20)
        pipeline_quiet()
    row.refresh_from_db()
    assert row.published_at is not None
    assert len(smtp.messages) == 1


def test_a_relay_killed_between_publish_and_mark_publishes_again_and_one_email_is_sent(
    client: Client, smtp: SmtpServer
) -> None:
    from core.celery import app

    with worker_thread():
        post_event(client, stripe_testing.encode(paid_event()))
        smtp.handler.wait_for(1, timeout=20)
        # The state a crash after publishing but before committing "published" leaves behind:
        # the message went out, the row is still unpublished.
        row = OutboxMessage.objects.get()
        OutboxMessage.objects.filter(pk=row.pk).update(published_at=None)
        app.send_task(
            row.task,
            args=row.args,
            task_id=outbox_task_id(row.pk),
            queue=row.queue,
        )
        assert outbox_relay() == 1
        pipeline_quiet()
    assert len(smtp.messages) == 1


def test_concurrent_relays_publish_each_row_exactly_once() -> None:
    queue = f"relaytest-{uuid.uuid4().hex[:8]}"
    OutboxMessage.objects.bulk_create(
        OutboxMessage(task="core.does_not_exist", args=[i], queue=queue) for i in range(300)
    )
    barrier = threading.Barrier(4)
    totals: list[int] = []

    def relay() -> None:
        try:
            barrier.wait()
            totals.append(outbox_relay(batch_size=25))
        finally:
            connection.close()

    threads = [threading.Thread(target=relay) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    task_ids = [m["headers"]["id"] for m in broker.queue_messages(queue)]
    broker.queue_delete(queue)
    assert sum(totals) == 300
    assert len(task_ids) == 300
    assert len(set(task_ids)) == 300
    assert not OutboxMessage.objects.filter(published_at__isnull=True).exists()


def test_relay_leaves_young_rows_to_their_own_publish() -> None:
    OutboxMessage.objects.create(task="core.does_not_exist", args=[1], queue="relaytest-young")
    assert outbox_relay(grace=timedelta(seconds=60)) == 0
    assert OutboxMessage.objects.get().published_at is None


def test_outbox_command_reports_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from django.core.management.base import CommandError

    call_command("outbox", "status")
    assert "unpublished: 0" in capsys.readouterr().out
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        call_command("outbox", "relay", "--batch-size", "0")


# Fails every mark (an UPDATE that sets published_at) while it exists.
REFUSE_MARKS = """
CREATE FUNCTION outbox_marks_refused() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'marks refused by the test'; END $$;
CREATE TRIGGER outbox_marks_refused BEFORE UPDATE OF published_at ON asyncwork_outboxmessage
FOR EACH ROW EXECUTE FUNCTION outbox_marks_refused();
"""
ALLOW_MARKS = """
DROP TRIGGER IF EXISTS outbox_marks_refused ON asyncwork_outboxmessage;
DROP FUNCTION IF EXISTS outbox_marks_refused();
"""


def test_a_mark_the_database_refuses_fails_no_request_and_leaves_the_row_to_the_relay(
    client: Client, smtp: SmtpServer
) -> None:
    """The mark after an on-commit publish fails (the database gone since the commit): the
    request still answers 200, and the row, left unpublished, is published again by the relay:
    a second message, never a lost one, and one email."""
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_MARKS)
    try:
        with worker_thread():
            assert post_event(client, stripe_testing.encode(paid_event())).status_code == 200
            smtp.handler.wait_for(1, timeout=20)
            row = OutboxMessage.objects.get()
            assert (row.published_at, row.publish_attempts) == (None, 0)
            with connection.cursor() as cursor:
                cursor.execute(ALLOW_MARKS)
            assert outbox_relay() == 1
            # The second message consumed (it finds the email sent) before counting emails.
            assert wait_until(
                lambda: broker.queue_depth(row.queue) == 0 and broker.held_unacknowledged() == 0,
                timeout=20,
            )
    finally:
        with connection.cursor() as cursor:
            cursor.execute(ALLOW_MARKS)
    row.refresh_from_db()
    assert row.published_at is not None
    assert len(smtp.messages) == 1
