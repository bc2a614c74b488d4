"""An email a safety net enqueues again does not wait behind the backlog queued since.

The rescue, the recovery and the reconcile enqueue onto the recovery queue, which a worker
takes before the email queue (``asyncwork.queues``). Here twenty emails wait in the email
queue before a worker starts, then the reconcile finds three more invoices that have waited
longer (no message at all); a real worker, one process, sends the three reconciled ones first.

On RabbitMQ, which cannot order a consumer's queues, there is no recovery queue: the
reconciled emails go to the email queue, behind the backlog, and all are sent.
"""

from __future__ import annotations

import pytest
from django.utils import timezone
from invoicing.jobs import invoices_reconcile

from asyncwork.models import OutboxMessage
from core.celery import app
from invoicing.models import EmailDelivery
from invoicing.services import EMAIL_QUEUE, EMAIL_RECOVERY_QUEUE, SEND_INVOICE_EMAIL_TASK
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

BACKLOG = 20
FORGOTTEN = 3


def test_a_reconciled_email_goes_before_the_backlog(smtp: SmtpServer) -> None:
    # An earlier test's worker (in this process, on threads) may still be closing its consumer.
    assert wait_until(lambda: broker.queue_consumers(EMAIL_QUEUE) == 0, 30)
    waiting = [paid_invoice() for _ in range(BACKLOG)]
    for invoice in waiting:
        # Published just now, as the webhook's commit does: the reconcile leaves them alone.
        OutboxMessage.objects.create(
            task=SEND_INVOICE_EMAIL_TASK,
            args=[invoice.pk],
            queue=EMAIL_QUEUE,
            published_at=timezone.now(),
        )
        app.send_task(SEND_INVOICE_EMAIL_TASK, args=[invoice.pk])
    # Paid, and their messages never made it to the broker.
    forgotten = [paid_invoice() for _ in range(FORGOTTEN)]

    assert invoices_reconcile() == FORGOTTEN
    rows = OutboxMessage.objects.filter(args__in=[[invoice.pk] for invoice in forgotten])
    lane = EMAIL_QUEUE if broker.RABBITMQ else EMAIL_RECOVERY_QUEUE
    assert {row.queue for row in rows} == {lane}
    if broker.RABBITMQ:
        assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == BACKLOG + FORGOTTEN, 10)
    else:
        assert wait_until(lambda: broker.queue_depth(EMAIL_RECOVERY_QUEUE) == FORGOTTEN, 10)
        assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == BACKLOG, 10)

    worker = launch.celery_worker(worker_env(smtp.port), name="order-worker", concurrency=1)
    try:
        worker.wait_ready()
        done = wait_until(
            lambda: EmailDelivery.objects.filter(state="sent").count() == BACKLOG + FORGOTTEN, 60
        )
    finally:
        worker.stop()
    assert done, worker.log_text()[-3000:]
    recipients = [message["To"] for message in smtp.messages]
    assert len(recipients) == BACKLOG + FORGOTTEN
    positions = sorted(recipients.index(invoice.customer_email) + 1 for invoice in forgotten)
    print(f"\nthe reconciled emails went out at positions {positions} of {len(recipients)}")
    assert positions[-1] <= (BACKLOG + FORGOTTEN if broker.RABBITMQ else FORGOTTEN)
