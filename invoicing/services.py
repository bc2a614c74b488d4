"""The email guarantee: one email per paid invoice, whatever runs twice.

The key ``invoice_email_sent:<invoice pk>`` is a UNIQUE ``EmailDelivery`` row. A worker sends
only after claiming it in one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` statement, which
succeeds for a new or failed key, or a claim whose lease expired or whose owner's heartbeat
lapsed; so racing workers send one email, and a run after success is a no-op. The owner's later
writes are fenced on the claim (``Claim.held``): a late owner, once overtaken, changes nothing.

Crash window: a worker that dies between the SMTP server's 250 and marking the key sent leaves
the claim in ``sending``. Once its lease (``EMAIL_CLAIM_LEASE_SECONDS``, longer than the task's
hard time limit) expires or its heartbeat lapses, a redelivery or the ``workers-rescue`` job
(``invoicing.jobs.email_claims_rescue``) sends again: at most one duplicate per crash, with the
same Message-ID. The breaker (``email_breaker``) is asked before the claim, so a deferred job
holds no claim and spends no attempt (``ProviderUnavailable``, ``ReliableTask.defer``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import NamedTuple

import stripe
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.mail import EmailMultiAlternatives
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from asyncwork.audit import operator_action_record
from asyncwork.breaker import Breaker, Decision
from asyncwork.db import insert_or_skip, text_storable
from asyncwork.errors import PermanentError, ProviderUnavailable, TransientError, Unreachable
from asyncwork.heartbeat import lapse_seconds, owner_lapsed_sql
from asyncwork.idempotency import Performed, idempotent_perform
from asyncwork.logging import log_context_bind
from asyncwork.outbox import outbox_enqueue
from asyncwork.queues import queue_declare
from invoicing import mail
from invoicing.models import EmailDelivery, Invoice
from webhooks.stripe_api import stripe_client, stripe_error_sorted

logger = logging.getLogger(__name__)

# Seconds a process trusts a closed-breaker read: another process's opening is seen this late.
BREAKER_CHECK_SECONDS = 1.0
EMAIL_KEY_PREFIX = "invoice_email_sent:"

SEND_INVOICE_EMAIL_TASK = "invoicing.send_invoice_email"  # invoicing/tasks.py
RESEND_INVOICE_EMAIL_TASK = "invoicing.resend_invoice_email"
# The email tasks' own queue: other jobs never delay an email; backpressure sheds on its depth.
EMAIL_QUEUE = queue_declare(
    "email", pressure=True, tasks=(SEND_INVOICE_EMAIL_TASK, RESEND_INVOICE_EMAIL_TASK)
)
# Emails a safety net re-enqueues (invoicing/jobs.py), read before EMAIL_QUEUE: they are older.
EMAIL_RECOVERY_QUEUE = queue_declare("email-recovery", pressure=True, ahead_of=EMAIL_QUEUE)


@dataclass(frozen=True)
class InvoiceData:
    """What we keep of a provider invoice, already validated."""

    provider_invoice_id: str
    number: str
    customer_email: str
    provider_customer_id: str
    customer_name: str
    amount_paid: int
    currency: str
    status: str
    hosted_invoice_url: str
    paid_at: datetime | None


def invoice_record_payment(*, data: InvoiceData, provider_time: datetime) -> Invoice | None:
    """Upsert an invoice from a payment event, in the caller's transaction, never backwards: an
    event older than the applied state changes nothing (None), and a paid invoice stays paid. The
    event that makes it paid writes the email to the outbox; ``recipient_override`` is kept, and
    so is an address read from the customer (``invoice_recipient_fetch``) while the provider's
    events carry none."""
    fields = {**asdict(data), "provider_updated_at": provider_time}
    if not data.customer_email:
        del fields["customer_email"]
    invoice = Invoice(**fields)
    if insert_or_skip(invoice, conflict_fields=["provider_invoice_id"]):
        was_paid = False
    else:
        # The row lock serialises events for one invoice; the comparison below is then exact.
        invoice = Invoice.objects.select_for_update().get(
            provider_invoice_id=data.provider_invoice_id
        )
        if provider_time < invoice.provider_updated_at:
            logger.info(
                "stale invoice event ignored",
                extra={"invoice_id": invoice.pk, "provider_time": provider_time},
            )
            return None
        was_paid = invoice.status == Invoice.Status.PAID
        paid_at_before = invoice.paid_at
        for name, value in fields.items():
            setattr(invoice, name, value)
        if was_paid:
            invoice.status = Invoice.Status.PAID
            invoice.paid_at = paid_at_before or data.paid_at
        invoice.save()
    log_context_bind(invoice_id=invoice.pk)
    if not was_paid and invoice.status == Invoice.Status.PAID:
        outbox_enqueue(task=SEND_INVOICE_EMAIL_TASK, args=[invoice.pk])
    return invoice


def invoice_email_key(invoice: Invoice) -> str:
    return f"{EMAIL_KEY_PREFIX}{invoice.pk}"


def invoice_email_message_id(invoice: Invoice, key: str) -> str:
    """Deterministic from the invoice and key: a duplicate after a crash carries the same one."""
    provider = re.sub(r"[^A-Za-z0-9_.-]", "", invoice.provider_invoice_id)[:64] or "invoice"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"<{provider}.{digest}@{mail.message_id_domain()}>"


# Returns the claim's row, token, Message-ID and take-over flag, or no row when not claimed. A
# claimed key keeps the Message-ID it recorded first.
_CLAIM_SQL = f"""
INSERT INTO {EmailDelivery._meta.db_table} AS d
    (key, invoice_id, state, attempts, claimed_by, lease_expires_at, message_id,
     provider_message_id, recipient, last_error, requested_by, created_at, updated_at)
VALUES (%(key)s, %(invoice_id)s, 'sending', 1, %(owner)s,
        now() + make_interval(secs => %(lease)s), %(message_id)s, '', '', '', '', now(), now())
ON CONFLICT (key) DO UPDATE
    SET state = 'sending', attempts = d.attempts + 1, claimed_by = EXCLUDED.claimed_by,
        lease_expires_at = EXCLUDED.lease_expires_at, updated_at = now()
    WHERE d.state IN ('pending', 'failed', 'bounced')
       OR (d.state = 'sending' AND d.lease_expires_at < now())
       OR (d.state = 'sending' AND {owner_lapsed_sql(owner="d.claimed_by", since="d.updated_at")})
RETURNING d.id, d.attempts, d.message_id, (d.xmax <> 0) AS reclaimed
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate


@dataclass(frozen=True)
class Claim:
    """A claim held; ``attempts`` is its token, raised by every claim of the row."""

    delivery_id: int
    attempts: int
    message_id: str
    owner: str

    def held(self) -> QuerySet[EmailDelivery]:
        """The row while this very claim is on it: the fence of the owner's later writes. A
        claim taken over since has another token, so they match nothing."""
        return EmailDelivery.objects.filter(
            pk=self.delivery_id, claimed_by=self.owner, attempts=self.attempts
        )


class ClaimRead(NamedTuple):
    invoice: Invoice
    claim: Claim | None


def _invoice_read(invoice_id: int) -> Invoice:
    """Raises ``PermanentError`` if there is none: no retry would find it."""
    try:
        return Invoice.objects.get(pk=invoice_id)
    except Invoice.DoesNotExist:
        raise PermanentError(f"invoice {invoice_id} does not exist") from None


def email_claim(*, invoice_id: int, key: str, owner: str) -> ClaimRead:
    """Read the invoice, then claim its email under ``key``: claim None if the invoice is not
    paid, or the key is sent or held by a live claim. Raises ``PermanentError`` if there is no
    invoice. A paid invoice stays paid, so the status read before the claim holds under it."""
    invoice = _invoice_read(invoice_id)
    if invoice.status != Invoice.Status.PAID:
        return ClaimRead(invoice, None)
    with connection.cursor() as cursor:
        cursor.execute(
            _CLAIM_SQL,
            {
                "key": key,
                "invoice_id": invoice.pk,
                "owner": owner[:255],
                "lease": settings.EMAIL_CLAIM_LEASE_SECONDS,
                "message_id": invoice_email_message_id(invoice, key),
                "heartbeat_lapse": lapse_seconds(),
            },
        )
        row = cursor.fetchone()
    if row is None:
        return ClaimRead(invoice, None)
    delivery_id, attempts, message_id, reclaimed = row
    if reclaimed:
        logger.info(
            "email claim taken (attempt %d)",
            attempts,
            extra={"invoice_id": invoice_id, "key": key, "attempt": attempts},
        )
    claim = Claim(
        delivery_id=delivery_id, attempts=attempts, message_id=message_id, owner=owner[:255]
    )
    return ClaimRead(invoice, claim)


def _claim_release(claim: Claim, *, error: str, recipient: str) -> None:
    claim.held().filter(state=EmailDelivery.State.SENDING).update(
        state=EmailDelivery.State.FAILED,
        lease_expires_at=None,
        last_error=error[:2000],
        recipient=recipient[:320],
    )


def _claim_mark_sent(claim: Claim, *, recipient: str, provider_message_id: str) -> bool:
    """Mark the key sent if this claim is still the row's (also after a rescue released it:
    it was sent); False if taken over. The message is already accepted, so a database blip is
    waited out (about 6 s), not turned into a retry that would send a duplicate."""
    for delay in (0.5, 1, 1.5, 3, None):
        try:
            marked = (
                claim.held()
                .filter(state__in=[EmailDelivery.State.SENDING, EmailDelivery.State.FAILED])
                .update(
                    state=EmailDelivery.State.SENT,
                    sent_at=timezone.now(),
                    lease_expires_at=None,
                    last_error="",
                    recipient=recipient[:320],
                    provider_message_id=provider_message_id[:255],
                    bounced_at=None,
                )
            )
            return marked > 0
        except (OperationalError, InterfaceError):
            if delay is None:
                raise
            logger.warning(
                "could not mark the email sent; retrying in %.1f s",
                delay,
                extra={"delivery_id": claim.delivery_id},
            )
            connection.close()
            time.sleep(delay)
    raise AssertionError("unreachable")  # the last delay is None: raised above


def email_breaker() -> Breaker:
    """The email provider's breaker, shared by every worker, from the settings as they are now."""
    return Breaker(
        "email",
        threshold=settings.EMAIL_BREAKER_FAILURE_THRESHOLD,
        reset_seconds=settings.EMAIL_BREAKER_RESET_SECONDS,
        # A probe whose worker died frees the probe once the task's hard limit has passed.
        probe_ttl_seconds=settings.EMAIL_TASK_TIME_LIMIT + 10,
        check_seconds=BREAKER_CHECK_SECONDS,
    )


def _provider_unavailable(retry_in: float) -> ProviderUnavailable:
    return ProviderUnavailable(
        f"email provider circuit open; next try in {retry_in:.1f} s",
        retry_in=retry_in,
        jitter=settings.EMAIL_BREAKER_RESET_SECONDS,
        deadline=settings.EMAIL_PROVIDER_DEADLINE_SECONDS,
    )


def _deliver(message: EmailMultiAlternatives, *, breaker: Breaker, decision: Decision) -> str:
    """``mail.deliver`` (the provider's message id, or ""), its outcome told to the breaker.
    Only ``Unreachable`` (refused, reset, timed out, 421) counts against it; any reply about
    the message (451 or 5xx) proves the provider up. A failed probe is deferred, not retried:
    it tested the provider for all, and charging its attempt would let a long outage exhaust
    the jobs that draw probes."""
    try:
        return mail.deliver(message)
    except Unreachable as exc:
        breaker.record_failure()
        if decision.probe:
            raise _provider_unavailable(breaker.reset_seconds) from exc
        raise
    except (TransientError, PermanentError):
        breaker.record_success()
        raise
    # A success is told to the breaker by the caller, after the key is marked sent: nothing
    # that can fail or be interrupted (a stalled Redis, a soft time limit) may stand between
    # the SMTP server's 250 and the mark, or a retry would send the email again.


def invoice_email_send(*, invoice_id: int, owner: str, key: str | None = None) -> str:
    """Send the paid-invoice email at most once under ``key`` (default: the payment email's).
    Returns ``sent``, ``not_paid`` or ``skipped`` (sent, or claimed elsewhere). Raises
    ``TransientError`` (retry), ``PermanentError`` (dead-letter) or ``ProviderUnavailable``
    (breaker open: defer, no attempt spent)."""
    log_context_bind(invoice_id=invoice_id)
    breaker = email_breaker()
    decision = breaker.allow()
    try:
        if not decision.allowed:
            # Deferred only if there is an email to send.
            if _invoice_read(invoice_id).status != Invoice.Status.PAID:
                return _not_paid(invoice_id)
            raise _provider_unavailable(decision.retry_in)
        return _invoice_email_send_claimed(
            invoice_id=invoice_id,
            key=key or f"{EMAIL_KEY_PREFIX}{invoice_id}",
            owner=owner,
            breaker=breaker,
            decision=decision,
        )
    finally:
        # A probe that never reached the provider (already sent, bad address, database error)
        # gives the probe back at once; after it recorded an outcome this is a no-op.
        breaker.release_probe(decision)


NO_RECIPIENT_WITHOUT_API = (
    "invoice has no customer email: set STRIPE_API_KEY so the recipient is read from the "
    "customer, or trigger with `stripe trigger invoice.paid --override "
    "customer:email=you@example.com`"
)


def invoice_recipient_fetch(invoice: Invoice) -> None:
    """Give an invoice with no recipient but a customer (Stripe's ``customer_email`` is null
    when the customer had no email as the invoice was finalized, as the Stripe CLI's have) the
    customer's email, read from the Stripe API in one call and kept on its row, so later sends
    read nothing. Raises ``TransientError`` (no answer, 429, 5xx: retried) or
    ``PermanentError`` (the API off, no such customer, one without a valid email)."""
    customer_id = invoice.provider_customer_id
    if invoice.recipient or not customer_id:
        return
    client = stripe_client()
    if client is None:
        raise PermanentError(NO_RECIPIENT_WITHOUT_API)
    try:
        customer = client.v1.customers.retrieve(customer_id)
    except stripe.StripeError as exc:
        raise stripe_error_sorted(exc, doing=f"reading customer {customer_id}") from exc
    email = customer.to_dict().get("email")
    if not isinstance(email, str) or not email.strip():
        raise mail.RecipientRejected(
            f"invoice has no customer email, nor has its customer {customer_id}: correct the "
            "recipient, then replay"
        )
    email = text_storable(email.strip())
    mail.recipient_address(email=email, name="")  # the send's own rules, before it is kept
    Invoice.objects.filter(pk=invoice.pk, customer_email="").update(customer_email=email)
    invoice.customer_email = email
    logger.info("invoice recipient read from its customer", extra={"invoice_id": invoice.pk})


def _not_paid(invoice_id: int) -> str:
    logger.info("invoice not paid; no email", extra={"invoice_id": invoice_id})
    return "not_paid"


def _invoice_email_send_claimed(
    *, invoice_id: int, key: str, owner: str, breaker: Breaker, decision: Decision
) -> str:
    invoice, claim = email_claim(invoice_id=invoice_id, key=key, owner=owner)
    if invoice.status != Invoice.Status.PAID:
        return _not_paid(invoice_id)
    if claim is None:
        logger.info(
            "invoice email already sent or in progress",
            extra={"invoice_id": invoice_id, "key": key},
        )
        return "skipped"
    # Built under the claim: a process paused here past the lapse sends at most the one
    # duplicate, with the same Message-ID.
    try:
        invoice_recipient_fetch(invoice)
        built = mail.invoice_email_build(invoice=invoice, message_id=claim.message_id, key=key)
        provider_message_id = _deliver(built, breaker=breaker, decision=decision)
    except Exception as exc:
        # Release whatever failed, so a retry or replay can claim again.
        words = isinstance(exc, (PermanentError, TransientError))
        _claim_release(claim, error=str(exc) if words else repr(exc), recipient=invoice.recipient)
        raise
    marked = _claim_mark_sent(
        claim, recipient=invoice.recipient, provider_message_id=provider_message_id
    )
    breaker.record_success()
    sent = {
        "invoice_id": invoice_id,
        "key": key,
        "attempt": claim.attempts,
        "message_id": claim.message_id,
    }
    if marked:
        logger.info("invoice email sent", extra=sent)
    else:
        logger.warning(
            "invoice email sent, but its claim was taken over meanwhile: this send is the "
            "one duplicate, with the same Message-ID",
            extra=sent,
        )
    return "sent"


INVOICE_EMAIL_RESEND = "invoice.email_resend"
INVOICE_RECIPIENT_CORRECT = "invoice.recipient_correct"


@dataclass(frozen=True)
class ResendRequest:
    delivery: EmailDelivery
    created: bool  # False: this idempotency key was seen before; nothing more was sent


@dataclass(frozen=True)
class ResendSelection:
    requested: list[EmailDelivery]  # one per paid invoice of the selection, in invoice order
    skipped: list[int]  # the selection's invoices that got none: not paid, or gone
    replayed: bool  # True: this key's selection was requested before; nothing more was sent


def invoice_email_resend_key(invoice_id: int, idempotency_key: str) -> str:
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
    return f"invoice_email_resend:{invoice_id}:{digest}"


def _user_key(user: AbstractBaseUser | AnonymousUser, idempotency_key: str) -> str:
    """An email's idempotency key derived from a user's own: unique per user and key."""
    return f"user:{user.pk}:{idempotency_key}"


def invoice_email_resend_request(
    *, invoice_id: int, idempotency_key: str, actor: str
) -> ResendRequest:
    """A deliberate new email for a paid invoice under a key of its own, recorded as an operator
    action; the same ``idempotency_key`` again sends nothing more. Raises
    ``Invoice.DoesNotExist``, or ``ValueError`` for an unpaid invoice."""
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.status != Invoice.Status.PAID:
        raise ValueError("only a paid invoice's email can be resent")
    key = invoice_email_resend_key(invoice.pk, idempotency_key)
    delivery = EmailDelivery(
        key=key,
        invoice=invoice,
        state=EmailDelivery.State.PENDING,
        message_id=invoice_email_message_id(invoice, key),
        requested_by=actor[:150],
    )
    with transaction.atomic():
        created = insert_or_skip(delivery, conflict_fields=["key"])
        if created:
            outbox_enqueue(task=RESEND_INVOICE_EMAIL_TASK, args=[delivery.pk])
            operator_action_record(
                action=INVOICE_EMAIL_RESEND,
                actor=actor,
                target=invoice,
                detail=f"requested under {key}",
            )
    if not created:
        delivery = EmailDelivery.objects.get(key=key)
    logger.info(
        "invoice email resend requested",
        extra={"invoice_id": invoice.pk, "key": key, "actor": actor, "duplicate": not created},
    )
    return ResendRequest(delivery=delivery, created=created)


def _recipient_state(invoice: Invoice) -> dict[str, str]:
    return {"recipient_override": invoice.recipient_override, "recipient": invoice.recipient}


class RecipientUnchanged(ValueError):
    """The correction asked for is the one in place: a repeat, nothing to do."""


def invoice_recipient_correct(*, invoice_id: int, email: str, reason: str, actor: str) -> Invoice:
    """Send this invoice's emails to ``email`` from now on (empty: remove the correction), kept
    in ``recipient_override`` so the provider's next event does not undo it, and recorded as an
    operator action with ``reason``. Sends nothing. Raises ``Invoice.DoesNotExist``,
    ``RecipientUnchanged`` for a correction changing nothing, or ``ValueError`` for an invalid
    address or a missing reason."""
    email = email.strip()
    reason = " ".join(reason.split())
    if email:
        try:
            # The send's own rules: a correction accepted here is one the send accepts.
            mail.recipient_address(email=email, name="")
        except PermanentError as exc:
            raise ValueError(f"{email!r} is not a valid email address: {exc}") from exc
    if not reason:
        raise ValueError("say why the recipient is corrected")
    with transaction.atomic():
        # Under the row lock a payment event takes too: the two never interleave.
        invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
        if email == invoice.recipient_override:
            raise RecipientUnchanged(
                f"the recipient is already {email}" if email else "there is no correction to remove"
            )
        before = _recipient_state(invoice)
        invoice.recipient_override = email
        invoice.save(update_fields=["recipient_override", "updated_at"])
        operator_action_record(
            action=INVOICE_RECIPIENT_CORRECT,
            actor=actor,
            target=invoice,
            detail=reason,
            before=before,
            after=_recipient_state(invoice),
        )
    log_context_bind(invoice_id=invoice.pk)
    logger.info(
        "invoice recipient corrected",
        extra={"invoice_id": invoice.pk, "actor": actor, "removed": not email},
    )
    return invoice


def recipient_now(invoice: Invoice) -> str:
    """Where an invoice's emails go after a correction, in words, for whoever made it."""
    if invoice.recipient_override:
        return f"emails now go to {invoice.recipient}"
    if invoice.recipient:
        return f"emails now go to {invoice.recipient} (the provider's address)"
    return "correction removed; the provider gave no address"


def invoice_email_resend_request_once(
    *,
    invoice_id: int,
    user: AbstractBaseUser | AnonymousUser,
    idempotency_key: str,
    fingerprint: str,
    request: str,
) -> ResendRequest:
    """The API's resend: ``invoice_email_resend_request`` once per (``user``,
    ``idempotency_key``) (``asyncwork.idempotency``). The same key and request returns the first
    delivery; the same key for another invoice raises ``IdempotencyKeyReused``. Raises like
    ``invoice_email_resend_request``, leaving the key unused."""
    performed = idempotent_perform(
        user=user,
        key=idempotency_key,
        fingerprint=fingerprint,
        request=request,
        perform=lambda: (
            invoice_email_resend_request(
                invoice_id=invoice_id,
                idempotency_key=_user_key(user, idempotency_key),
                actor=f"api:{user.get_username()}",
            ).delivery
        ),
    )
    if performed.result is None:
        raise ValueError("the email requested under this Idempotency-Key no longer exists")
    return ResendRequest(delivery=performed.result, created=not performed.replayed)


def invoice_email_resend_selection_once(
    *,
    invoice_ids: Collection[int],
    user: AbstractBaseUser | AnonymousUser,
    idempotency_key: str,
    actor: str,
) -> ResendSelection:
    """The admin's bulk resend: ``invoice_email_resend_request`` for each invoice, in one
    transaction, once per (``user``, ``idempotency_key``). The same key and selection again (a
    double submit) sends nothing more and reports the first; another selection raises
    ``IdempotencyKeyReused``. Unpaid or gone invoices are skipped."""
    ids = sorted(set(invoice_ids))
    email_key = _user_key(user, idempotency_key)

    def perform() -> None:
        for invoice_id in ids:
            try:
                invoice_email_resend_request(
                    invoice_id=invoice_id, idempotency_key=email_key, actor=actor
                )
            except (Invoice.DoesNotExist, ValueError):
                continue  # reported from what was requested, below: the same for a replay

    canonical = ",".join(map(str, ids))
    performed: Performed[EmailDelivery] = idempotent_perform(
        user=user,
        key=idempotency_key,
        fingerprint=hashlib.sha256(
            f"invoice_email_resend_selection:{canonical}".encode()
        ).hexdigest(),
        request=f"resend invoice email: {len(ids)} invoice(s) selected in the admin",
        perform=perform,
    )
    keys = [invoice_email_resend_key(invoice_id, email_key) for invoice_id in ids]
    requested = list(EmailDelivery.objects.filter(key__in=keys).order_by("invoice_id"))
    got = {delivery.invoice_id for delivery in requested}
    return ResendSelection(
        requested=requested,
        skipped=[invoice_id for invoice_id in ids if invoice_id not in got],
        replayed=performed.replayed,
    )
