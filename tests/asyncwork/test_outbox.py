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
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client

from asyncwork.models import OutboxMessage
from asyncwork.outbox import _connection_drop, outbox_relay, outbox_task_id
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import worker_thread
from tests.helpers.redis_server import PrivateRedis
from tests.helpers.stripe import paid_event, post_event
from webhooks import testing as stripe_testing

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stallable_broker(private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The broker is a Redis of this test's own, which it may stall: the machine's is shared.
    Publishes (this thread's kept outbox connection) and the worker go there."""
    from core.celery import app

    # Celery reads the environment's CELERY_BROKER_URL before its own setting.
    monkeypatch.setenv("CELERY_BROKER_URL", private_redis.url)
    monkeypatch.setattr(app.conf, "broker_url", private_redis.url)
    _connection_drop()
    yield private_redis.client()
    _connection_drop()


@broker.redis_only  # a shared RabbitMQ node cannot be stalled for one test
def test_stalled_broker_at_commit_leaves_the_row_for_the_relay(
    client: Client, smtp: SmtpServer, stallable_broker: redis.Redis
) -> None:
    body = stripe_testing.encode(paid_event())
    stallable_broker.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # the broker stalls
    started = time.monotonic()
    response = post_event(client, body)
    elapsed = time.monotonic() - started

    assert response.status_code == 200
    assert elapsed < settings.OUTBOX_PUBLISH_TIMEOUT + 1.0
    row = OutboxMessage.objects.get()
    assert row.published_at is None
    assert row.publish_attempts == 1
    assert "imeout" in row.last_error

    time.sleep(2.6)  # the stall ends
    with worker_thread():
        call_command("outbox", "relay", "--grace", "0")
        smtp.handler.wait_for(1, timeout=20)
        time.sleep(1)
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
            kwargs={"outbox_id": row.pk},
            task_id=outbox_task_id(row.pk),
            queue=row.queue,
        )
        assert outbox_relay() == 1
        time.sleep(2)
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


def test_the_outbox_publishes_the_message_celery_send_task_builds() -> None:
    """The outbox's own publisher (a prebuilt message through one producer per thread) sends,
    byte for byte but the transport's delivery tag, what ``send_task`` would: Celery's message
    protocol 2 with the same headers (the log context's included), body and properties, and
    tells ``after_task_publish``'s receivers as ``send_task`` does."""
    from celery.signals import after_task_publish

    from asyncwork import outbox
    from asyncwork.logging import log_context
    from core.celery import app

    told: list[tuple[Any, ...]] = []

    def receiver(sender: str, headers: dict[str, Any], routing_key: str, **_: Any) -> None:
        told.append((sender, headers["id"], routing_key))

    after_task_publish.connect(receiver, weak=False, dispatch_uid="test-after-publish")
    for task, queue in [
        ("invoicing.send_invoice_email", "email"),  # a task this process knows: its limits
        ("core.does_not_exist", f"relaytest-{uuid.uuid4().hex[:8]}"),  # one it does not
    ]:
        with log_context(event_id="evt_format", invoice_id=7):
            app.send_task(
                task,
                args=[7],
                kwargs={"outbox_id": 9},
                queue=queue,
                task_id=outbox_task_id(9),
                connection=outbox._connection(),
                retry=False,
            )
            row = OutboxMessage(pk=9, task=task, args=[7], kwargs={}, queue=queue)
            assert outbox._send(row) is None
        # Redis keeps kombu's whole envelope (its delivery tag differs per message); RabbitMQ
        # hands back the headers and the body.
        sent_by_celery, sent_by_outbox = broker.queue_messages(queue)
        if queue != "email":
            # Only the queue made up here: deleting the app's own would leave its exchange
            # with no queue bound, where every later publish of this process is dropped
            # (kombu remembers it declared it). The fixture empties it.
            broker.queue_delete(queue)
        for message in (sent_by_celery, sent_by_outbox):
            message.get("properties", {}).pop("delivery_tag", None)
        assert sent_by_outbox["headers"]["log_context"] == {
            "event_id": "evt_format",
            "invoice_id": 7,
        }
        assert sent_by_outbox == sent_by_celery
        assert told == [(task, outbox_task_id(9), queue)] * 2
        told.clear()
    after_task_publish.disconnect(dispatch_uid="test-after-publish")
