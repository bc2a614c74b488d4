"""The safety nets of the email guarantee, scheduled jobs (``asyncwork.jobs.job``).

* ``email_claims_recover``: a claim still ``sending`` after its lease belongs to a worker that
  died (SIGKILL, hard time limit) after claiming; release it and enqueue the email again. A
  resend still ``pending`` after the quiet period lost its message; enqueue it again.
  The same takeover happens when the dead worker's message is redelivered; this job does not
  wait for the broker's visibility timeout, and it also covers a message the broker lost.
* ``invoices_reconcile``: a paid invoice with no email sent and nothing pending for
  ``RECONCILE_QUIET_SECONDS`` (no live claim, no recent or unpublished outbox row, no dead
  letter waiting for a human) gets its email enqueued again. This is what recovers the jobs a
  Redis restart dropped (Redis keeps nothing on disk here). It also runs at once when the
  beat leader sees the broker restart or the database come back (``asyncwork.recovery``), as
  ``invoices_reconcile_now``: after a broker restart without the quiet period, since the
  restart provably dropped what was queued before it; after a database reconnect with it,
  since the broker lost nothing. Re-enqueueing an email that is still queued or being sent is
  harmless to the guarantee (its claim is the fence: the second message finds it sent or
  claimed and skips), but it is one more message in the queue.

* ``email_claims_rescue`` (a rescue, ``asyncwork.rescue.rescue``, run by the machinery's
  ``workers-rescue`` job every few seconds): a claim still ``sending`` whose owner's heartbeat
  lapsed belongs to a process that is gone (SIGKILL, a host lost, a pause past the lapse); release
  it and enqueue the email again at once, without waiting for its lease.

All enqueue through the outbox onto the recovery queue (``EMAIL_RECOVERY_QUEUE``), which a
worker takes before the email queue (on Redis; on RabbitMQ it is the email queue): what a
safety net finds has waited longest, and would otherwise wait again behind every email queued
since (after a Redis restart, the whole backlog). All are safe to run twice: what they
enqueue is pending afterwards, so the next run leaves it alone.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from asyncwork.heartbeat import lapse_seconds, owner_lapsed_sql
from asyncwork.jobs import BROKER_RESTARTED, job
from asyncwork.outbox import outbox_enqueue
from asyncwork.rescue import rescue
from invoicing.models import EmailDelivery
from invoicing.services import (
    EMAIL_RECOVERY_QUEUE,
    RESEND_INVOICE_EMAIL_TASK,
    SEND_INVOICE_EMAIL_TASK,
    email_breaker,
)

EMAIL_KEY_PREFIX = "invoice_email_sent:"
# How far back reconcile looks for a paid invoice with no email: a week covers any outage
# worth repairing by itself; older ones are an operator's to resend.
RECONCILE_WINDOW_DAYS = 7


@job("email-claims-recover", every=timedelta(seconds=60))
def email_claims_recover(*, limit: int = 500) -> int:
    """Release claims whose lease expired and re-enqueue their emails, and re-enqueue resends
    still pending after the quiet period (their message was lost); returns how many."""
    now = timezone.now()
    quiet_since = now - timedelta(seconds=settings.RECONCILE_QUIET_SECONDS)
    with transaction.atomic():
        stale = list(
            EmailDelivery.objects.select_for_update(skip_locked=True)
            .filter(
                Q(state=EmailDelivery.State.SENDING, lease_expires_at__lt=now)
                | Q(state=EmailDelivery.State.PENDING, updated_at__lt=quiet_since)
            )
            .order_by("pk")[:limit]
        )
        for delivery in stale:
            if delivery.state == EmailDelivery.State.SENDING:
                delivery.state = EmailDelivery.State.FAILED
                delivery.lease_expires_at = None
                delivery.last_error = (
                    f"claim by {delivery.claimed_by} expired unfinished; re-enqueued by recovery"
                )
            delivery.save(update_fields=["state", "lease_expires_at", "last_error", "updated_at"])
            _enqueue_again(delivery)
    return len(stale)


def _enqueue_again(delivery: EmailDelivery) -> None:
    """Onto the recovery queue, which workers take before the email queue: the email has
    waited since its first enqueue, longer than anything queued behind it."""
    if delivery.key.startswith(EMAIL_KEY_PREFIX):
        outbox_enqueue(
            task=SEND_INVOICE_EMAIL_TASK, args=[delivery.invoice_id], queue=EMAIL_RECOVERY_QUEUE
        )
    else:
        outbox_enqueue(
            task=RESEND_INVOICE_EMAIL_TASK, args=[delivery.pk], queue=EMAIL_RECOVERY_QUEUE
        )


# A claim in ``sending`` is as old as its ``updated_at``: nothing else writes a claimed row.
_RESCUE_SQL = f"""
SELECT d.id FROM invoicing_emaildelivery d
WHERE d.state = 'sending'
  AND {owner_lapsed_sql(owner="d.claimed_by", since="d.updated_at")}
ORDER BY d.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""  # noqa: S608 - no input: the heartbeat predicate is fixed SQL


# At once, once the claim's owner is gone (its heartbeat lapsed): the workers-rescue job.
@rescue("email-claims")
def email_claims_rescue(*, limit: int = 500) -> int:
    """Release the claims whose owner is gone (its heartbeat lapsed: ``asyncwork.heartbeat``)
    and re-enqueue their emails at once, without waiting for their lease; returns how many.

    The row keeps its owner and token: a claim nobody has taken since may still be marked sent
    by its owner, if it was only paused and its send went through; the re-enqueued message
    then finds the email sent. Once another worker claims it, the old owner's writes match
    nothing (``invoicing.services.Claim.held``)."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_RESCUE_SQL, {"limit": limit, "heartbeat_lapse": lapse_seconds()})
            ids = [row[0] for row in cursor.fetchall()]
        # Locked above: no claim can change these rows before this transaction ends.
        rescued = list(EmailDelivery.objects.filter(pk__in=ids).order_by("pk"))
        for delivery in rescued:
            delivery.state = EmailDelivery.State.FAILED
            delivery.lease_expires_at = None
            delivery.last_error = (
                f"the heartbeat of {delivery.claimed_by}, which claimed it, lapsed; "
                "re-enqueued by rescue"
            )
            delivery.save(update_fields=["state", "lease_expires_at", "last_error", "updated_at"])
            _enqueue_again(delivery)
    return len(rescued)


_RECONCILE_SQL = """
SELECT i.id FROM invoicing_invoice i
WHERE i.status = 'paid' AND i.provider_updated_at >= %(since)s
  AND NOT EXISTS (
    SELECT 1 FROM invoicing_emaildelivery d
    WHERE d.key = %(prefix)s || i.id::text
      AND (d.state <> 'failed' OR d.updated_at >= %(quiet_since)s))
  AND NOT EXISTS (
    SELECT 1 FROM asyncwork_deadletter l
    WHERE l.task = %(task)s AND l.args = jsonb_build_array(i.id) AND l.replayed_at IS NULL)
  AND NOT EXISTS (
    SELECT 1 FROM asyncwork_outboxmessage o
    WHERE o.task = %(task)s AND o.args = jsonb_build_array(i.id)
      AND (o.published_at IS NULL OR o.published_at >= %(quiet_since)s))
ORDER BY i.id
LIMIT %(limit)s
"""


def invoices_reconcile_now(reason: str) -> int | str:
    """The reconcile at once after a restart. After a broker restart (``reason``
    ``BROKER_RESTARTED``), every paid invoice with no email sent, no live claim, no unpublished
    outbox row and no dead letter waiting gets its email enqueued, however recently its message
    was published or its attempt failed: the restart dropped every queued message. After a
    database reconnect, the quiet period holds as in the periodic run: the broker still holds
    every message queued before, and re-enqueueing those would double the queue."""
    return invoices_reconcile(quiet_seconds=0 if reason == BROKER_RESTARTED else None)


# Periodically, and at once after a broker restart or a database reconnect (asyncwork.recovery).
@job("email-reconcile", every=timedelta(seconds=120), on_recovery=invoices_reconcile_now)
def invoices_reconcile(*, limit: int = 1000, quiet_seconds: int | None = None) -> int | str:
    """Enqueue the email of every paid invoice that has none and nothing pending.

    ``quiet_seconds`` (``RECONCILE_QUIET_SECONDS`` unless given): how long a published
    message, or a failed attempt, counts as pending.

    Stands aside while the provider's breaker is not closed: jobs deferred by an open breaker
    hold no claim and would look lost, and enqueueing more of them only grows the queue."""
    breaker = email_breaker().state()["state"]
    if breaker != "closed":
        return f"skipped: email provider breaker {breaker}"
    now = timezone.now()
    quiet = settings.RECONCILE_QUIET_SECONDS if quiet_seconds is None else quiet_seconds
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                _RECONCILE_SQL,
                {
                    "since": now - timedelta(days=RECONCILE_WINDOW_DAYS),
                    "quiet_since": now - timedelta(seconds=quiet),
                    "prefix": EMAIL_KEY_PREFIX,
                    "task": SEND_INVOICE_EMAIL_TASK,
                    "limit": limit,
                },
            )
            invoice_ids = [row[0] for row in cursor.fetchall()]
        for invoice_id in invoice_ids:
            outbox_enqueue(
                task=SEND_INVOICE_EMAIL_TASK, args=[invoice_id], queue=EMAIL_RECOVERY_QUEUE
            )
    return len(invoice_ids)
