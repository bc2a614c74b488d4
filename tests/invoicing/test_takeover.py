"""A dead worker's email, through the machinery: the job it was running is given back by the
workers' rescue (``asyncwork.rescue``, run by every worker's poll), and its next run takes the
email's claim over (``invoicing.tasks``), so the invoice gets its email without waiting for
anything else to notice. Each case with a real worker (on threads, in this process), its poll,
the broker and an SMTP server; the dead worker is the rows its run left behind.

* Rescue by heartbeat off (leases alone): a job whose lease expired is run again, and takes over
  the claim whose lease expired too; a job and a claim still within their leases are left.
* By heartbeat: a job and claim whose owner's heartbeat lapsed are taken over well inside their
  leases; those of an owner that beats are left, however old.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from asyncwork.contrib.monitoring.metrics import worker_rescues
from asyncwork.models import Job, WorkerHeartbeat
from asyncwork.rescue import jobs_rescue, workers_rescue
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import email_claim, invoice_email_key, send_invoice_email
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import a_lapsed_and_a_live_worker, worker_thread

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = timedelta(hours=1)


def running(invoice: Invoice, *, owner: str, lease: timedelta, age: timedelta) -> Job:
    """The email job of ``invoice`` as a run of ``owner`` left it, begun ``age`` ago: RUNNING,
    its lease ending ``lease`` from now, and the email's claim taken, under the same lease."""
    result = send_invoice_email.using(run_after=timezone.now() + timedelta(days=1)).enqueue(
        invoice.pk
    )
    Job.objects.filter(pk=result.id).update(
        status=Job.Status.RUNNING,
        owner=owner,
        attempts=1,
        worker_ids=[owner],
        due_at=None,
        published_at=Now() - age,
        started_at=Now() - age,
        last_attempted_at=Now() - age,
        lease_expires_at=Now() + lease,
    )
    claimed = email_claim(invoice_id=invoice.pk, key=invoice_email_key(invoice.pk), owner=owner)
    assert claimed.claim is not None
    EmailDelivery.objects.filter(invoice=invoice).update(
        lease_expires_at=Now() + lease, updated_at=Now() - age
    )
    return Job.objects.get(pk=result.id)


def test_a_run_past_its_lease_is_run_again_and_takes_the_expired_claim_over(
    smtp: SmtpServer, settings: Any
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": 0}
    stale = running(
        paid_invoice("in_stale"), owner="dead-worker", lease=-timedelta(seconds=1), age=HOUR
    )
    live = running(
        paid_invoice("in_live"), owner="live-worker", lease=timedelta(minutes=5), age=HOUR
    )

    with worker_thread():
        smtp.handler.wait_for(1, timeout=20)
        # Nothing left to rescue: safe to run again, in every worker.
        assert workers_rescue()["jobs"] == 0

    [message] = smtp.messages
    assert message["To"] == "in_stale@example.com"
    delivery = EmailDelivery.objects.get(invoice__provider_invoice_id="in_stale")
    assert (delivery.state, delivery.attempts, delivery.lease_expires_at) == ("sent", 2, None)
    stale.refresh_from_db()
    assert (stale.status, stale.attempts, stale.owner) == ("SUCCESSFUL", 2, "")
    # The one job, run again: not a second one.
    assert Job.objects.filter(args=stale.args).count() == 1
    live.refresh_from_db()
    assert (live.status, live.owner, live.attempts) == ("RUNNING", "live-worker", 1)
    live_claim = EmailDelivery.objects.get(invoice__provider_invoice_id="in_live")
    assert (live_claim.state, live_claim.attempts) == ("sending", 1)


def test_a_gone_owners_job_and_claim_are_taken_over_at_once_and_a_beating_ones_are_left(
    smtp: SmtpServer,
) -> None:
    WorkerHeartbeat.objects.create(
        owner="long-dead",
        hostname="h",
        pid=1,
        started_at=timezone.now() - 3 * HOUR,
        beat_at=timezone.now() - 2 * HOUR,
    )
    rescues = worker_rescues().labels(rescue="jobs")
    before = rescues._value.get()
    with a_lapsed_and_a_live_worker() as beating:
        gone = running(
            paid_invoice("in_gone"),
            owner="gone-host:41:dead",
            lease=timedelta(minutes=5),
            age=timedelta(minutes=2),
        )
        alive = running(
            paid_invoice("in_alive"),
            owner=beating.owner,
            lease=timedelta(minutes=5),
            age=HOUR,
        )
        with worker_thread():
            smtp.handler.wait_for(1, timeout=20)
            assert workers_rescue()["jobs"] == 0
        alive.refresh_from_db()
        alive_claim = EmailDelivery.objects.get(invoice__provider_invoice_id="in_alive")

    [message] = smtp.messages
    assert message["To"] == "in_gone@example.com"
    rescued = EmailDelivery.objects.get(invoice__provider_invoice_id="in_gone")
    assert (rescued.state, rescued.attempts, rescued.lease_expires_at) == ("sent", 2, None)
    # Taken over well inside its leases: the heartbeat said its owner was gone.
    assert rescued.sent_at is not None
    assert gone.lease_expires_at is not None
    assert rescued.sent_at < gone.lease_expires_at - timedelta(minutes=4)
    gone.refresh_from_db()
    assert (gone.status, gone.attempts) == ("SUCCESSFUL", 2)
    assert Job.objects.filter(args=gone.args).count() == 1
    assert (alive.status, alive.owner, alive.attempts) == ("RUNNING", beating.owner, 1)
    assert (alive_claim.state, alive_claim.attempts) == ("sending", 1)
    assert rescues._value.get() == before + 1
    assert not WorkerHeartbeat.objects.filter(owner="long-dead").exists()


def published_waiting(task: str, *, published_at: datetime) -> Job:
    """A job published at ``published_at`` and not started: its message in the broker, or lost."""
    return Job.objects.create(
        task=task, args=[], queue="default", published_at=published_at, publish_attempts=1
    )


def test_a_job_published_as_a_consumer_died_is_published_again_once_its_heartbeat_lapsed() -> None:
    with a_lapsed_and_a_live_worker():
        died = WorkerHeartbeat.objects.get(owner="gone-host:41:dead").beat_at
        # Published a moment after the dead process's last beat, never started: its message may
        # have died with a consumer that had taken it from Redis.
        taken = published_waiting("tests.tasks.nap", published_at=died + timedelta(seconds=1))
        # Published long before, and since: messages still in the broker, left alone.
        backlog = published_waiting("tests.tasks.nap", published_at=died - timedelta(minutes=1))
        since = published_waiting("tests.tasks.nap", published_at=timezone.now())

        rescued = jobs_rescue()
        again = jobs_rescue()  # every worker's poll runs it: once published again, left

    taken.refresh_from_db()
    if broker.RABBITMQ:  # RabbitMQ gives a dead consumer's deliveries back itself
        assert (rescued, taken.published_at) == (0, died + timedelta(seconds=1))
    else:
        assert rescued == 1
        assert (taken.published_at, taken.status) == (None, "READY")
        assert taken.due_at is not None  # the relay publishes it now, ahead of its queue
    assert again == 0
    for job in (backlog, since):
        assert Job.objects.get(pk=job.pk).published_at == job.published_at


def test_a_job_finding_its_email_claimed_waits_and_sends_once_the_claim_ends(
    smtp: SmtpServer, settings: Any
) -> None:
    """A claim left in ``sending`` by a live process (a run that could not release it when the
    database went away): the job is not done while nothing was sent. It waits, spending no
    attempt, and takes the claim over once its lease ends."""
    settings.EMAIL_CLAIM_LEASE_SECONDS = 20
    invoice = paid_invoice("in_left")
    with a_lapsed_and_a_live_worker() as live:
        claimed = email_claim(
            invoice_id=invoice.pk, key=invoice_email_key(invoice.pk), owner=live.owner
        )
        assert claimed.claim is not None
        EmailDelivery.objects.filter(invoice=invoice).update(
            lease_expires_at=Now() + timedelta(seconds=4)
        )
        job = send_invoice_email.enqueue(invoice.pk)
        with worker_thread():
            assert smtp.handler.wait_for(1, timeout=30)
            assert wait_until(lambda: Job.objects.get(pk=job.id).status == "SUCCESSFUL", 20)
    done = Job.objects.get(pk=job.id)
    assert (done.return_value, done.attempts, done.errors) == ("sent", 1, [])
    assert done.deferred_since is not None
    delivery = EmailDelivery.objects.get(invoice=invoice)
    assert (delivery.state, delivery.attempts) == ("sent", 2)
    assert len(smtp.messages) == 1
