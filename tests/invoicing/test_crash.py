"""The crash window, for real: SIGKILL the only worker (parent included) while it is in the
SMTP conversation, start a new one, and the invoice still gets its email, within the bound the
heartbeat sets, and never more than the documented duplicate carrying the same Message-ID.

Nothing else runs: the new worker's poll finds the dead worker's heartbeat lapsed, gives its job
back and publishes it again (``asyncwork.rescue``), and the job's next run takes the email's claim
over (``invoicing.tasks``). The worker runs with the timing scaled down (visibility 20 s), so
that the dead worker's own message comes back within the test too, on Redis after the visibility
timeout, on RabbitMQ at once as its connection closes: it finds the job taken (or done) and does
nothing more. ``test_default_recovery_bound`` checks the bound at the defaults.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings

from asyncwork.backend import TIME_LIMIT_GRACE
from asyncwork.models import Job
from asyncwork.poll import POLL_SECONDS
from asyncwork.rescue import RESCUE_EVERY
from asyncwork.settings import asyncwork_settings
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
# A dead worker's job is published again once its heartbeat lapsed, at the next rescue, and
# run from the poll after: the bound, at the defaults.
RESCUE_BOUND = (
    float(asyncwork_settings.WORKER_HEARTBEAT_LAPSE_SECONDS)
    + RESCUE_EVERY.total_seconds()
    + POLL_SECONDS
)


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
        job_id = int(send_invoice_email.enqueue(invoice.pk).id)
        assert wait_until(lambda: smtp.handler.attempts >= 1, timeout=20)
        first.kill()  # the whole worker, parent included: nothing is left to requeue
        killed_at = time.monotonic()
        assert EmailDelivery.objects.get().state == "sending"  # the claim is orphaned
        assert Job.objects.get(pk=job_id).status == "RUNNING"  # and so is the job

        smtp.handler.faults.delay = 0
        second = launch.celery_worker(env, name="survivor")
        second.wait_ready()
        started_after = time.monotonic() - killed_at
        assert wait_until(
            lambda: EmailDelivery.objects.get().state == "sent",
            timeout=RESCUE_BOUND + started_after + 10,
        ), second.log_text()[-3000:]
        recovered_after = time.monotonic() - killed_at
        # Until the dead worker's message came back and was done with.
        pipeline_quiet(timeout=int(SCALED["TEST_VISIBILITY_TIMEOUT"]) + RESTORE_INTERVAL + 20)
        log = second.log_text()
    finally:
        first.kill()
        if second is not None:
            second.stop()

    messages = smtp.messages
    delivery = EmailDelivery.objects.get()
    assert 1 <= len(messages) <= 2  # the crashed attempt may have been accepted: one duplicate
    assert {m["Message-ID"] for m in messages} == {delivery.message_id}
    assert delivery.attempts == 2
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == ("SUCCESSFUL", 2)
    if not broker.RABBITMQ:
        # On RabbitMQ the message returned at once may find the owner lapsed already and run it.
        assert "rescue jobs: 1 job(s)" in log
    # The dead worker's message, back: claimed by nobody, it ran nothing.
    assert "'skipped'" in log
    print(
        f"\nrecovered {recovered_after:.1f} s after the kill (the new worker ready after "
        f"{started_after:.1f} s); {len(messages)} message(s)"
    )


def test_default_recovery_bound() -> None:
    """At the defaults, a SIGKILLed worker's job is run again within the heartbeat's lapse and a
    rescue period: well inside a minute, and long before the leases or Redis's visibility
    timeout would have brought it back; a live worker is never judged gone between two of its
    beats, nor its claim taken over while its send may still be running."""
    beat = float(asyncwork_settings.WORKER_HEARTBEAT_SECONDS)
    assert float(asyncwork_settings.WORKER_HEARTBEAT_LAPSE_SECONDS) >= 3 * beat
    assert RESCUE_BOUND <= 30
    hard_limit = settings.EMAIL_TASK_SOFT_TIME_LIMIT + TIME_LIMIT_GRACE
    assert hard_limit < settings.EMAIL_CLAIM_LEASE_SECONDS
    # Redis only: RabbitMQ has no visibility timeout.
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout")
    assert visibility is None or visibility > hard_limit
    assert RESCUE_BOUND < settings.EMAIL_CLAIM_LEASE_SECONDS
