"""The safety nets of the email guarantee: scheduled jobs (``asyncwork.jobs.job``) and a rescue.

Each re-enqueues through the outbox onto ``EMAIL_RECOVERY_QUEUE``, read before the email queue
(what a safety net finds has waited longest), and is safe to run twice: what it enqueued is
pending afterwards. A second message for an email still queued or sending finds its claim and
skips.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from asyncwork.heartbeat import lapse_seconds, owner_lapsed_sql
from asyncwork.jobs import job
from asyncwork.outbox import outbox_enqueue
from asyncwork.rescue import rescue
from invoicing.models import EmailDelivery
from invoicing.services import (
    EMAIL_KEY_PREFIX,
    EMAIL_RECOVERY_QUEUE,
    RESEND_INVOICE_EMAIL_TASK,
    SEND_INVOICE_EMAIL_TASK,
    email_breaker,
)

# How far back reconcile looks; older invoices are an operator's to resend.
RECONCILE_WINDOW_DAYS = 7


@job("email-claims-recover", every=timedelta(seconds=60))
def email_claims_recover(*, limit: int = 500) -> int:
    """Release claims whose lease expired (their worker died) and re-enqueue their emails, and
    re-enqueue resends still pending after the quiet period (message lost); returns how many."""
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
                why = f"claim by {delivery.claimed_by} expired unfinished; re-enqueued by recovery"
                _release(delivery, why)
            else:
                delivery.save(update_fields=["updated_at"])  # pending: a new quiet period
            _enqueue_again(delivery)
    return len(stale)


def _release(delivery: EmailDelivery, why: str) -> None:
    delivery.state = EmailDelivery.State.FAILED
    delivery.lease_expires_at = None
    delivery.last_error = why
    delivery.save(update_fields=["state", "lease_expires_at", "last_error", "updated_at"])


def _enqueue_again(delivery: EmailDelivery) -> None:
    if delivery.key.startswith(EMAIL_KEY_PREFIX):
        task, args = SEND_INVOICE_EMAIL_TASK, [delivery.invoice_id]
    else:
        task, args = RESEND_INVOICE_EMAIL_TASK, [delivery.pk]
    outbox_enqueue(task=task, args=args, queue=EMAIL_RECOVERY_QUEUE)


# A claim in ``sending`` is as old as its ``updated_at``: nothing else writes a claimed row.
_RESCUE_SQL = f"""
SELECT d.id FROM invoicing_emaildelivery d
WHERE d.state = 'sending'
  AND {owner_lapsed_sql(owner="d.claimed_by", since="d.updated_at")}
ORDER BY d.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""  # noqa: S608 - no input: the heartbeat predicate is fixed SQL


@rescue("email-claims")
def email_claims_rescue(*, limit: int = 500) -> int:
    """Run by the ``workers-rescue`` job: release the claims whose owner's heartbeat lapsed and
    re-enqueue their emails without waiting for the lease; returns how many. The row keeps its
    owner and token, so a paused owner whose send went through may still mark it sent."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_RESCUE_SQL, {"limit": limit, "heartbeat_lapse": lapse_seconds()})
            ids = [row[0] for row in cursor.fetchall()]
        # Locked above: no claim can change these rows before this transaction ends.
        rescued = list(EmailDelivery.objects.filter(pk__in=ids).order_by("pk"))
        for delivery in rescued:
            why = f"the heartbeat of {delivery.claimed_by}, which claimed it, lapsed"
            _release(delivery, f"{why}; re-enqueued by rescue")
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


def invoices_reconcile_now() -> int | str:
    """The reconcile at once after the broker lost its queued messages, without the quiet
    period: no message of a paid invoice with nothing pending is still queued."""
    return invoices_reconcile(quiet_seconds=0)


@job("email-reconcile", every=timedelta(seconds=120), on_recovery=invoices_reconcile_now)
def invoices_reconcile(*, limit: int = 1000, quiet_seconds: int | None = None) -> int | str:
    """Enqueue the email of every paid invoice that has none sent and nothing pending (no live
    claim, no dead letter waiting, no outbox row unpublished or younger than ``quiet_seconds``,
    default ``RECONCILE_QUIET_SECONDS``): this recovers the jobs a Redis restart dropped.

    Stands aside unless the breaker is closed: jobs it deferred hold no claim and look lost."""
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
