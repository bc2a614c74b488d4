"""The crash window, for real: SIGKILL the whole worker (parent included) while it is in the
SMTP conversation, start a new one, and the invoice still gets its email, within the bound
the visibility timeout and the claim lease set, and never more than the documented duplicate
carrying the same Message-ID.

The worker here runs with the timing scaled down (visibility 20 s, lease 10 s) so the test
takes seconds; ``test_default_recovery_bound`` checks the same relation at the defaults. On
RabbitMQ the message comes back at once, before the lease expires, and the claims recovery job
takes the email over once it has.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings

from core.celery import app
from invoicing.models import EmailDelivery
from invoicing.tasks import send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env
from tests.helpers.quiescence import pipeline_quiet

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# Redis: how often kombu looks for messages whose visibility timeout passed.
RESTORE_INTERVAL = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("unacked_restore_interval", 0)


def test_worker_killed_during_smtp_recovers_with_at_most_one_same_id_duplicate(
    smtp: SmtpServer,
) -> None:
    invoice = paid_invoice("in_crash")
    smtp.handler.faults.delay = 3  # the server holds its reply to DATA: the worker waits in it
    env = worker_env(smtp.port, SCALED, **SCALED_BREAKER)
    first = launch.celery_worker(env, name="doomed")
    second = None
    try:
        first.wait_ready()
        send_invoice_email.delay(invoice.pk)
        assert wait_until(lambda: smtp.handler.attempts >= 1, timeout=20)
        first.kill()  # the whole worker, parent included: nothing is left to requeue
        killed_at = time.monotonic()
        assert EmailDelivery.objects.get().state == "sending"  # the claim is orphaned

        smtp.handler.faults.delay = 0
        second = launch.celery_worker(env, name="survivor")
        second.wait_ready()
        bound = int(SCALED["CELERY_VISIBILITY_TIMEOUT"]) + RESTORE_INTERVAL + 10
        if broker.RABBITMQ:
            # RabbitMQ redelivers as soon as the dead worker's connection closes, while the
            # claim's lease still runs: the redelivery finds the claim live and leaves it. The
            # claims recovery, which beat runs every minute, re-enqueues the email once the
            # lease has expired; here it is sent as beat would, once the lease is over.
            assert wait_until(lambda: "succeeded" in second.log_text(), timeout=10)
            assert "'skipped'" in second.log_text()
            lease = int(SCALED["EMAIL_CLAIM_LEASE_SECONDS"])
            time.sleep(max(0.0, lease + 1 - (time.monotonic() - killed_at)))
            app.send_task("email-claims-recover")
            bound = lease + 10
        assert wait_until(lambda: EmailDelivery.objects.get().state == "sent", timeout=bound)
        recovered_after = time.monotonic() - killed_at
        pipeline_quiet()
    finally:
        first.kill()
        if second is not None:
            second.stop()

    messages = smtp.messages
    delivery = EmailDelivery.objects.get()
    assert 1 <= len(messages) <= 2  # the crashed attempt may have been accepted: one duplicate
    assert {m["Message-ID"] for m in messages} == {delivery.message_id}
    assert delivery.attempts == 2
    print(f"recovered {recovered_after:.1f} s after the kill; {len(messages)} message(s)")


@broker.redis_only  # the visibility timeout is Redis's
def test_default_recovery_bound() -> None:
    """At the defaults, a message held by a SIGKILLed worker is redelivered within
    visibility timeout + restore interval, the redelivery finds the claim's lease expired,
    and that is inside five minutes."""
    visibility = settings.CELERY_VISIBILITY_TIMEOUT
    assert visibility > settings.EMAIL_CLAIM_LEASE_SECONDS  # the redelivery can take over
    assert settings.EMAIL_CLAIM_LEASE_SECONDS > settings.EMAIL_TASK_TIME_LIMIT
    assert visibility + RESTORE_INTERVAL <= 300
