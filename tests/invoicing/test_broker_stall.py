"""A broker stall while a task finishes must not leave the worker connected but idle.

With Redis paused for writes, the acknowledgement of a finished email task times out. kombu's
Redis QoS.ack raises before releasing the prefetch slot, so each failed ack would keep one slot
forever and a worker with one slot would fetch nothing more; ``asyncwork.broker`` releases the
slot whatever the ack did. The message itself stays in the unacknowledged index and comes back
after the visibility timeout, where the email's key makes the redelivery a no-op.

It stalls a Redis of its own (``private_redis``): the machine's is shared.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings

from core.celery import app
from invoicing.models import EmailDelivery
from invoicing.services import SEND_INVOICE_EMAIL_TASK
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env
from tests.helpers.redis_server import PrivateRedis

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

STALL_MS = 6000  # longer than the broker socket timeout (2 s): the ack times out
UNACKED = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "unacked"


def _send(redis_server: PrivateRedis, invoice_id: int) -> None:
    with app.connection_for_write(redis_server.url) as conn:
        app.send_task(SEND_INVOICE_EMAIL_TASK, args=[invoice_id], connection=conn)


def test_worker_consumes_again_after_a_stall_made_its_ack_fail(
    smtp: SmtpServer, private_redis: PrivateRedis
) -> None:
    first, later = paid_invoice(), [paid_invoice() for _ in range(3)]
    smtp.handler.faults.delay = 2  # the task is in SMTP when the broker stalls
    # Visibility timeout 20 s instead of 180 s, so the stalled ack's message comes back here.
    env = worker_env(smtp.port, SCALED, CELERY_BROKER_URL=private_redis.url, **SCALED_BREAKER)
    worker = launch.celery_worker(env, name="stalled", concurrency=1)
    broker = private_redis.client()
    try:
        worker.wait_ready()
        _send(private_redis, first.pk)
        assert wait_until(lambda: smtp.handler.attempts >= 1, timeout=20)
        broker.execute_command("CLIENT", "PAUSE", STALL_MS, "WRITE")
        stalled_until = time.monotonic() + STALL_MS / 1000
        assert wait_until(lambda: EmailDelivery.objects.filter(state="sent").count() == 1, 20)
        time.sleep(max(0.0, stalled_until - time.monotonic()) + 1)
        smtp.handler.faults.delay = 0

        for invoice in later:
            _send(private_redis, invoice.pk)
        sent = wait_until(lambda: EmailDelivery.objects.filter(state="sent").count() == 4, 30)
        # The first message, whose ack failed, is still unacknowledged in Redis (the later
        # ones leave the index with their acks, a moment after they are marked sent)...
        stranded = wait_until(lambda: broker.hlen(UNACKED) == 1, 10, interval=0.1)
        # ...until the visibility timeout brings it back and its redelivery is acknowledged.
        redelivered = wait_until(lambda: broker.hlen(UNACKED) == 0, 60, interval=1)
        log = worker.log_text()
    finally:
        broker.execute_command("CLIENT", "UNPAUSE")
        broker.close()
        worker.stop()
    assert sent, f"the worker took nothing after the stall:\n{log[-3000:]}"
    assert stranded, "the first message's failed ack should have left it unacknowledged"
    assert redelivered
    assert "invoice email already sent or in progress" in log  # the redelivery found it sent
    assert len(smtp.messages) == 4  # and sent nothing more
    assert EmailDelivery.objects.get(invoice=first).attempts == 1
