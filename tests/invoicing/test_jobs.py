"""The email guarantee's safety nets: stale-claim recovery, the rescue of a gone worker's
claims, and the reconcile job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now
from django.utils import timezone
from invoicing.jobs import email_claims_recover, invoices_reconcile

from asyncwork.models import DeadLetter, OutboxMessage, WorkerHeartbeat
from asyncwork.rescue import RESCUES, workers_rescue
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import email_claim, invoice_email_key
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_thread

pytestmark = pytest.mark.django_db(transaction=True)


def long_ago() -> Any:
    return timezone.now() - timedelta(hours=1)


def test_recovery_releases_expired_claims_once_and_the_email_goes_out(smtp: SmtpServer) -> None:
    invoice = paid_invoice("in_stale")
    live = paid_invoice("in_live")
    assert (
        email_claim(
            invoice_id=invoice.pk, key=invoice_email_key(invoice), owner="dead-worker"
        ).claim
        is not None
    )
    assert (
        email_claim(invoice_id=live.pk, key=invoice_email_key(live), owner="live-worker").claim
        is not None
    )
    EmailDelivery.objects.filter(invoice=invoice).update(lease_expires_at=long_ago())

    with worker_thread():
        assert email_claims_recover() == 1
        assert email_claims_recover() == 0  # safe twice: nothing stale is left
        smtp.handler.wait_for(1, timeout=20)
    [message] = smtp.messages
    assert message["To"] == "in_stale@example.com"
    assert EmailDelivery.objects.get(invoice=invoice).state == "sent"
    assert EmailDelivery.objects.get(invoice=live).state == "sending"  # a live claim is left


def test_rescue_releases_the_claims_of_gone_owners_at_once_and_the_email_goes_out(
    smtp: SmtpServer,
) -> None:
    """The workers-rescue job (its registered email rescue): a claim whose owner's heartbeat
    lapsed is released and its email enqueued through the outbox, well inside its lease; a
    claim whose owner beats is left, however old; heartbeat rows dead for an hour go."""
    gone, alive = paid_invoice("in_gone"), paid_invoice("in_alive")
    for owner, ago in (("gone-worker", 60), ("live-worker", 0), ("long-dead", 7200)):
        WorkerHeartbeat.objects.create(
            owner=owner,
            hostname="h",
            pid=1,
            started_at=timezone.now(),
            beat_at=timezone.now() - timedelta(seconds=ago),
        )
    assert (
        email_claim(invoice_id=gone.pk, key=invoice_email_key(gone), owner="gone-worker").claim
        is not None
    )
    assert (
        email_claim(invoice_id=alive.pk, key=invoice_email_key(alive), owner="live-worker").claim
        is not None
    )
    EmailDelivery.objects.update(updated_at=Now() - timedelta(seconds=60))
    before = RESCUES.labels(rescue="email-claims")._value.get()

    with worker_thread():
        assert workers_rescue() == {"email-claims": 1, "held-jobs": 0, "heartbeats_deleted": 1}
        # Safe to run twice: nothing left to rescue or delete.
        assert workers_rescue() == {"email-claims": 0, "held-jobs": 0, "heartbeats_deleted": 0}
        smtp.handler.wait_for(1, timeout=20)
    [message] = smtp.messages
    assert message["To"] == "in_gone@example.com"
    rescued = EmailDelivery.objects.get(invoice=gone)
    assert (rescued.state, rescued.attempts) == ("sent", 2)
    assert rescued.lease_expires_at is None
    assert EmailDelivery.objects.get(invoice=alive).state == "sending"
    assert OutboxMessage.objects.filter(args=[gone.pk]).count() == 1
    assert RESCUES.labels(rescue="email-claims")._value.get() == before + 1
    assert not WorkerHeartbeat.objects.filter(owner="long-dead").exists()


def test_reconcile_enqueues_only_paid_invoices_with_nothing_pending() -> None:
    lost = paid_invoice("in_lost")  # its message was lost with a Redis restart
    OutboxMessage.objects.create(
        task="invoicing.send_invoice_email", args=[lost.pk], queue="email", published_at=long_ago()
    )
    OutboxMessage.objects.filter(args=[lost.pk]).update(created_at=long_ago())
    never = paid_invoice("in_never")  # no trace at all
    failed_long_ago = paid_invoice("in_failed")  # its retry was lost
    EmailDelivery.objects.create(
        key=invoice_email_key(failed_long_ago),
        invoice=failed_long_ago,
        state="failed",
        message_id="<x>",
    )
    EmailDelivery.objects.filter(invoice=failed_long_ago).update(updated_at=long_ago())

    sent = paid_invoice("in_sent")
    EmailDelivery.objects.create(
        key=invoice_email_key(sent), invoice=sent, state="sent", message_id="<s>"
    )
    in_progress = paid_invoice("in_progress")
    assert (
        email_claim(invoice_id=in_progress.pk, key=invoice_email_key(in_progress), owner="w").claim
        is not None
    )
    retrying = paid_invoice("in_retrying")  # failed a moment ago: its retry is in the broker
    EmailDelivery.objects.create(
        key=invoice_email_key(retrying), invoice=retrying, state="failed", message_id="<r>"
    )
    queued = paid_invoice("in_queued")  # published a moment ago
    OutboxMessage.objects.create(
        task="invoicing.send_invoice_email",
        args=[queued.pk],
        queue="email",
        published_at=timezone.now(),
    )
    unpublished = paid_invoice("in_unpublished")  # the relay's to publish
    OutboxMessage.objects.create(
        task="invoicing.send_invoice_email", args=[unpublished.pk], queue="email"
    )
    dead = paid_invoice("in_dead")  # waits for a human
    DeadLetter.objects.create(
        task="invoicing.send_invoice_email",
        task_id="t",
        args=[dead.pk],
        queue="email",
        reason="permanent",
        attempts=1,
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )
    paid_invoice("in_open", status="open")
    old = paid_invoice("in_old")
    Invoice.objects.filter(pk=old.pk).update(
        provider_updated_at=timezone.now() - timedelta(days=30)
    )

    before = set(OutboxMessage.objects.values_list("pk", flat=True))
    assert invoices_reconcile() == 3
    enqueued = OutboxMessage.objects.exclude(pk__in=before)
    assert sorted(a[0] for a in enqueued.values_list("args", flat=True)) == sorted(
        [lost.pk, never.pk, failed_long_ago.pk]
    )
    assert invoices_reconcile() == 0  # safe twice: what it enqueued is pending now


def test_reconcile_stands_aside_while_the_breaker_is_open(settings: Any) -> None:
    from invoicing.services import email_breaker

    paid_invoice("in_waiting")
    settings.EMAIL_BREAKER_FAILURE_THRESHOLD = 1
    email_breaker().record_failure()
    assert email_breaker().state()["state"] == "open"
    assert invoices_reconcile() == "skipped: email provider breaker open"
    assert not OutboxMessage.objects.exists()
    email_breaker().reset()
    assert invoices_reconcile() == 1
