"""``tests.helpers.quiescence`` on the real pipeline's places, either broker: quiet only when no
job is on its way (a job due and unpublished or running, a message waiting or held by a
consumer, a claim sending), waiting while one is, and naming it when the wait runs out."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from asyncwork.models import Job
from core.celery import app
from invoicing.models import EmailDelivery
from invoicing.tasks import EMAIL_QUEUE
from stack.net import wait_until
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.quiescence import pipeline_busy, pipeline_quiet

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _nothing_on_its_way() -> None:
    """Each test here asserts what is on its way, so it starts once nothing is: on RabbitMQ a
    message an earlier module's worker held comes back to its queue when the node sees that
    connection closed, which can be after the queues were emptied for this test."""

    def emptied() -> bool:
        broker.queues_empty()
        return not pipeline_busy()

    assert wait_until(emptied, timeout=15), pipeline_busy()


def test_a_retry_due_later_is_not_on_its_way() -> None:
    Job.objects.create(
        task="core.nothing", queue="default", due_at=timezone.now() + timedelta(hours=1)
    )
    assert pipeline_busy() == []
    pipeline_quiet(timeout=10)


def test_a_job_due_is_waited_for_until_it_is_published() -> None:
    row = Job.objects.create(task="core.nothing", args=[1], queue="default")
    assert pipeline_busy() == [f"1 job(s) due and unpublished [({row.pk}, 'core.nothing')]"]

    def publish_later() -> None:
        time.sleep(1.5)
        try:
            Job.objects.filter(pk=row.pk).update(published_at=timezone.now())
        finally:
            connection.close()  # this thread's

    publisher = threading.Thread(target=publish_later)
    started = time.monotonic()
    publisher.start()
    pipeline_quiet(timeout=20)
    publisher.join()
    assert time.monotonic() - started >= 1.5


def test_a_job_running_is_waited_for_until_it_has_an_outcome() -> None:
    row = Job.objects.create(
        task="core.nothing", queue="default", published_at=timezone.now(), status="RUNNING"
    )
    assert pipeline_busy() == [f"1 job(s) running [({row.pk}, 'core.nothing')]"]

    def succeed_later() -> None:
        time.sleep(1.5)
        try:
            Job.objects.filter(pk=row.pk).update(status=Job.Status.SUCCESSFUL)
        finally:
            connection.close()  # this thread's

    runner = threading.Thread(target=succeed_later)
    started = time.monotonic()
    runner.start()
    pipeline_quiet(timeout=20)
    runner.join()
    assert time.monotonic() - started >= 1.5


def test_a_message_waiting_or_held_unacknowledged_is_busy_and_a_timeout_names_it() -> None:
    app.send_task("core.nothing", queue=EMAIL_QUEUE)
    assert wait_until(lambda: pipeline_busy() == [f"1 message(s) in {EMAIL_QUEUE}"], timeout=10)
    with pytest.raises(pytest.fail.Exception, match=r"not quiet within 1 s: 1 message\(s\) in"):
        pipeline_quiet(timeout=1)

    # Taken by a consumer that has not acknowledged it, as a worker running it holds it.
    with app.connection_for_read() as conn:
        channel: Any = conn.channel()
        message = channel.basic_get(EMAIL_QUEUE, no_ack=False)
        assert message is not None
        held = "unacked" if not broker.RABBITMQ else EMAIL_QUEUE
        assert wait_until(lambda: pipeline_busy() == [f"1 message(s) in {held}"], timeout=10)
        channel.basic_ack(message.delivery_tag)
        assert wait_until(lambda: pipeline_busy() == [], timeout=10)
        channel.close()


def test_a_claim_sending_is_busy() -> None:
    EmailDelivery.objects.create(
        key="invoice_email_sent:quiet",
        invoice=paid_invoice(),
        state=EmailDelivery.State.SENDING,
        message_id="<quiet@example.com>",
    )
    assert pipeline_busy() == ["1 claim(s) sending ['invoice_email_sent:quiet']"]
