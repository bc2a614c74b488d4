"""A broker stall while a task finishes must not leave the worker connected but idle.

With Redis paused for writes, the acknowledgement of a finished email job times out. kombu's
Redis QoS.ack raises before releasing the prefetch slot, so each failed ack would keep one slot
forever and a worker with one slot would fetch nothing more; ``asyncwork.broker`` releases the
slot whatever the ack did. The message itself stays in the unacknowledged index and comes back
after the visibility timeout, where the job, done, makes the redelivery a no-op.

It stalls a Redis of its own (``private_redis``): the machine's is shared.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.utils import timezone

from asyncwork.models import Job
from invoicing.models import EmailDelivery
from invoicing.tasks import send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env
from tests.helpers.redis_server import PrivateRedis

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

STALL_MS = 6000  # longer than the broker socket timeout (2 s): the ack times out
UNACKED = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "unacked"


def _send(invoice_id: int) -> int:
    """Enqueue the invoice's email, due now: the worker's relay publishes it, to its own broker
    (this process's on-commit publish would go to the run's shared one)."""
    return int(send_invoice_email.using(run_after=timezone.now()).enqueue(invoice_id).id)


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
        first_job = _send(first.pk)
        assert wait_until(lambda: smtp.handler.attempts >= 1, timeout=20)
        broker.execute_command("CLIENT", "PAUSE", STALL_MS, "WRITE")
        stalled_until = time.monotonic() + STALL_MS / 1000
        assert wait_until(lambda: EmailDelivery.objects.filter(state="sent").count() == 1, 20)
        time.sleep(max(0.0, stalled_until - time.monotonic()) + 1)
        smtp.handler.faults.delay = 0

        for invoice in later:
            _send(invoice.pk)
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
    # The redelivery found the job done, and ran nothing: the job was claimed once.
    assert f"[job-{first_job}] succeeded in" in log
    assert "'skipped'" in log
    assert Job.objects.get(pk=first_job).attempts == 1
    assert len(smtp.messages) == 4  # and sent nothing more
    assert EmailDelivery.objects.get(invoice=first).attempts == 1
