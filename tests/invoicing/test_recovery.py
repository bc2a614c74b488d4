"""A broker that lost its queues is recovered at once, by the worker alone: its poll sees the
broker's run id change (or the marker it keeps there gone: a broker emptied without a restart)
and publishes again every job published and not started (``asyncwork.recovery``), without
waiting for any timeout.

Real processes throughout: a private ``redis-server`` (no persistence) as the broker, one
worker and an SMTP server; no beat. Redis is shut down with ``SHUTDOWN NOSAVE`` while emails
are queued (every queued message is gone) and started again on the same port.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.utils import timezone

from asyncwork.models import Job
from asyncwork.recovery import MARKER_KEY
from invoicing.models import EmailDelivery
from invoicing.tasks import send_invoice_email
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
def test_a_broker_that_lost_its_queues_is_recovered_within_seconds(
    smtp: SmtpServer, private_redis: PrivateRedis, fault: str
) -> None:
    """``restart``: SHUTDOWN NOSAVE and a new Redis process (a new run id). ``flush``: FLUSHALL
    on the running Redis (the same run id; the marker the worker keeps in it is gone), as a
    failover to an empty replica or an operator's mistake would leave it."""
    marker = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + MARKER_KEY
    env = worker_env(smtp.port, CELERY_BROKER_URL=private_redis.url)
    worker = launch.celery_worker(env, name="recovery-worker", concurrency=1)
    try:
        worker.wait_ready()
        smtp.handler.faults.delay = 0.3  # emails wait in the queue
        # Due now, so the worker's relay publishes them, to its broker (this process's
        # on-commit publish would go to the run's shared one).
        due_now = send_invoice_email.using(run_after=timezone.now())
        for _ in range(INVOICES):
            due_now.enqueue(paid_invoice().pk)
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
        print(
            f"\nbroker {fault} with {INVOICES - sent_before} of {INVOICES} emails unsent: "
            f"every invoice emailed {seconds:.1f} s after Redis came back"
        )
        assert wait_until(
            lambda: not Job.objects.exclude(status=Job.Status.SUCCESSFUL).exists(), 10
        )
        log = worker.log_text()
    finally:
        smtp.handler.faults.delay = 0
        worker.stop()
    assert sent_before < INVOICES, "every email went out before the fault: no test"
    assert done, log[-3000:]
    assert seconds <= GOAL_SECONDS
    assert "the broker lost its messages:" in log
    if fault == "flush":
        assert "the broker lost its data without restarting (its marker is gone)" in log
    # One email per invoice, each job run to success once: no email twice.
    ids = [message["Message-ID"] for message in smtp.messages]
    assert len(ids) == len(set(ids)) == INVOICES
    assert set(Job.objects.values_list("status", flat=True)) == {"SUCCESSFUL"}
