"""A broker restart is recovered at once: the beat leader sees the broker's run id change (or
its marker gone: a broker emptied without a restart) and runs the reconcile in its recovery
mode, without waiting for its period or the quiet period.

Real processes throughout: a private ``redis-server`` (no persistence) as the broker, a beat,
a worker and an SMTP server. Redis is shut down with ``SHUTDOWN NOSAVE`` while emails are
queued (every queued message is gone) and started again on the same port.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.utils import timezone

from asyncwork.models import OutboxMessage, ScheduledJob
from asyncwork.recovery import MARKER_KEY
from core.celery import app
from invoicing.models import EmailDelivery
from invoicing.services import EMAIL_QUEUE, SEND_INVOICE_EMAIL_TASK
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env
from tests.helpers.redis_server import PrivateRedis

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

INVOICES = 30
GOAL_SECONDS = 30  # the goal: every email sent within 30 s of Redis's restart or flush


@pytest.mark.parametrize("fault", ["restart", "flush"])
def test_a_broker_that_lost_its_queues_is_reconciled_within_seconds(
    smtp: SmtpServer, private_redis: PrivateRedis, fault: str
) -> None:
    """``restart``: SHUTDOWN NOSAVE and a new Redis process (a new run id). ``flush``: FLUSHALL
    on the running Redis (the same run id; the marker beat keeps in it is gone), as a failover
    to an empty replica or an operator's mistake would leave it."""
    marker = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + MARKER_KEY
    env = worker_env(smtp.port, CELERY_BROKER_URL=private_redis.url)
    beat = launch.celery_beat(env, name="recovery-beat")
    worker = launch.celery_worker(env, name="recovery-worker", concurrency=1)
    try:
        beat.wait_ready()
        worker.wait_ready()
        smtp.handler.faults.delay = 0.3  # emails wait in the queue
        invoices = [paid_invoice() for _ in range(INVOICES)]
        with app.connection_for_write(private_redis.url) as conn:
            for invoice in invoices:
                # As the outbox relay publishes it: the row says published, just now.
                OutboxMessage.objects.create(
                    task=SEND_INVOICE_EMAIL_TASK,
                    args=[invoice.pk],
                    queue=EMAIL_QUEUE,
                    published_at=timezone.now(),
                )
                app.send_task(SEND_INVOICE_EMAIL_TASK, args=[invoice.pk], connection=conn)
        assert wait_until(lambda: len(smtp.messages) >= 3, 30)

        if fault == "restart":
            private_redis.shutdown_nosave()
            sent_before = EmailDelivery.objects.filter(state="sent").count()
            private_redis.start()
        else:
            assert wait_until(lambda: private_redis.client().exists(marker), 15)
            private_redis.client().flushall()
            sent_before = EmailDelivery.objects.filter(state="sent").count()
        restarted = time.monotonic()
        done = wait_until(
            lambda: EmailDelivery.objects.filter(state="sent").count() == INVOICES,
            GOAL_SECONDS + 30,
            interval=0.2,
        )
        seconds = time.monotonic() - restarted
        # The periodic reconcile would not have enqueued them: their messages were published
        # within RECONCILE_QUIET_SECONDS (600 s). Only the recovery run did.
        recovery_runs = ScheduledJob.objects.get(name="email-reconcile").runs
        print(
            f"\nbroker {fault} with {INVOICES - sent_before} of {INVOICES} emails unsent: "
            f"every invoice emailed {seconds:.1f} s after Redis came back"
        )
        beat_log, worker_log = beat.log_text(), worker.log_text()
    finally:
        smtp.handler.faults.delay = 0
        worker.stop()
        beat.stop()
    assert sent_before < INVOICES, "every email went out before the restart: no test"
    assert done, f"not every invoice emailed:\n{beat_log[-3000:]}\n{worker_log[-3000:]}"
    assert seconds <= GOAL_SECONDS
    assert "recovery: broker_restarted" in beat_log
    assert recovery_runs >= 1
    # No email twice: each message carries its invoice's one Message-ID.
    ids = [message["Message-ID"] for message in smtp.messages]
    assert len(ids) == len(set(ids)) == INVOICES
