"""An email the machinery publishes again does not wait behind the backlog queued since.

A job's first publish goes to its queue; any later one (the relay publishing what the broker
refused at commit, a retry or a rescued run come due, a job the broker lost) goes to the queue
read ahead of it (``asyncwork.broker``). Here twenty emails wait in the email queue before a
worker starts; three more invoices' jobs, written earlier, have waited longer (their publish
failed at commit), and the relay publishes them; a real worker, one process, sends those three
first.

On RabbitMQ, which cannot order a consumer's queues, the queue read ahead is the email queue
itself: the three go behind the backlog, and all are sent.
"""

from __future__ import annotations

import pytest

from asyncwork.backend import relay
from asyncwork.broker import ahead
from asyncwork.models import Job
from invoicing.models import EmailDelivery
from invoicing.tasks import EMAIL_QUEUE, send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

BACKLOG = 20
WAITED = 3


def test_a_job_published_again_goes_before_the_backlog(smtp: SmtpServer) -> None:
    # An earlier test's worker (in this process, on threads) may still be closing its consumer.
    assert wait_until(lambda: broker.queue_consumers(EMAIL_QUEUE) == 0, 30)
    # Paid first; the broker refused their publish at commit, as it leaves such a row.
    waited = [paid_invoice() for _ in range(WAITED)]
    rows = Job.objects.bulk_create(
        Job(
            task=send_invoice_email.module_path,
            args=[invoice.pk],
            queue=EMAIL_QUEUE,
            publish_attempts=1,
            last_error="OperationalError('Error 111 connecting to 127.0.0.1:6379.')",
        )
        for invoice in waited
    )
    # Paid since, and published as their payments committed.
    for _ in range(BACKLOG):
        send_invoice_email.enqueue(paid_invoice().pk)

    assert relay() == WAITED  # the relay each worker's poll runs, here run once by hand
    again = ahead(EMAIL_QUEUE)
    assert not Job.objects.filter(published_at__isnull=True).exists()
    published = Job.objects.filter(pk__in=[row.pk for row in rows])
    assert list(published.values_list("publish_attempts", flat=True)) == [2] * WAITED
    if broker.RABBITMQ:
        assert again == EMAIL_QUEUE
        assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == BACKLOG + WAITED, 10)
    else:
        assert again == f"{EMAIL_QUEUE}-recovery"
        assert wait_until(lambda: broker.queue_depth(again) == WAITED, 10)
        assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == BACKLOG, 10)

    worker = launch.celery_worker(worker_env(smtp.port), name="order-worker", concurrency=1)
    try:
        worker.wait_ready()
        done = wait_until(
            lambda: EmailDelivery.objects.filter(state="sent").count() == BACKLOG + WAITED, 60
        )
    finally:
        worker.stop()
    assert done, worker.log_text()[-3000:]
    recipients = [message["To"] for message in smtp.messages]
    assert len(recipients) == BACKLOG + WAITED
    positions = sorted(recipients.index(invoice.customer_email) + 1 for invoice in waited)
    print(f"\nthe jobs published again went out at positions {positions} of {len(recipients)}")
    assert positions[-1] <= (BACKLOG + WAITED if broker.RABBITMQ else WAITED)
