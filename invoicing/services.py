"""The email guarantee: one email per paid invoice, whatever runs twice.

The key ``invoice_email_sent:<invoice pk>`` is an ``EmailDelivery`` row under a UNIQUE
constraint. A worker sends only after it has *claimed* that row with one atomic
``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` statement: the claim succeeds for a new key, a
key whose last attempt failed, or a claim whose lease has expired or whose owner is gone; it
fails for a key already sent or claimed by a live worker. So two workers racing for one invoice
send one email, and a run after success is a no-op.

A claim records its owner, the worker process (``asyncwork.heartbeat.heartbeat_owner``), and a
token (``attempts``, raised by every claim). Every later write of the owner (the release, the
mark sent) is fenced on both (``Claim.held``): once the claim is taken over, a late owner (a
process paused past the lapse, then resumed) changes nothing. The worker reads the invoice,
claims its key, then builds the message under the claim and sends it: a pause past the lapse
anywhere between the claim and the server's reply is the crash window below.

The crash window: a worker that dies after the SMTP server accepted the message but before it
marked the key sent leaves a claim in ``sending``. The claim blocks every other worker while
its owner lives: for ``EMAIL_CLAIM_LEASE_SECONDS`` (longer than the task's hard time limit, so
a live owner is never overtaken) unless the owner's heartbeat lapses first
(``WORKER_HEARTBEAT_LAPSE_SECONDS``, by the database's clock). Then a redelivered message takes
the claim over, or the ``workers-rescue`` job releases it and re-enqueues the email
(``invoicing.jobs.email_claims_rescue``), and it is sent again: at most one duplicate per crash,
carrying the same deterministic Message-ID so the receiving side can collapse it.

The provider's circuit breaker (``email_breaker``) is asked before the claim, so a job it
defers holds no claim: while it is open no worker touches SMTP, and the job is re-published
without spending an attempt (``ProviderUnavailable``, ``ReliableTask.defer``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.mail import EmailMultiAlternatives
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from asyncwork.breaker import Breaker, Decision
from asyncwork.db import insert_or_skip
from asyncwork.errors import PermanentError, ProviderUnavailable, TransientError, Unreachable
from asyncwork.heartbeat import lapse_seconds, owner_lapsed_sql
from asyncwork.idempotency import Performed, idempotent_perform
from asyncwork.logging import log_context_bind
from asyncwork.outbox import outbox_enqueue
from asyncwork.queues import queue_declare
from invoicing import mail
from invoicing.models import EmailDelivery, Invoice
from operators.audit import operator_action_record

logger = logging.getLogger(__name__)

# Seconds a worker process trusts a read of the breaker closed with no failure counted: one
# Redis read per second while it is closed, not two round trips per email; another process's
# opening of it is seen up to this late.
BREAKER_CHECK_SECONDS = 1.0

SEND_INVOICE_EMAIL_TASK = "invoicing.send_invoice_email"  # invoicing/tasks.py
RESEND_INVOICE_EMAIL_TASK = "invoicing.resend_invoice_email"
# The email tasks' own queue, so a flood of other jobs never delays an email (a worker's alone
# if it is started with -Q); its depth is work accepted and not yet done, which backpressure
# sheds on.
EMAIL_QUEUE = queue_declare(
    "email", pressure=True, tasks=(SEND_INVOICE_EMAIL_TASK, RESEND_INVOICE_EMAIL_TASK)
)
# The emails a safety net enqueues again (a rescue, the recovery, the reconcile:
# invoicing/jobs.py), read before EMAIL_QUEUE: they are older than anything waiting there
# (asyncwork/queues.py; on RabbitMQ it is EMAIL_QUEUE).
EMAIL_RECOVERY_QUEUE = queue_declare("email-recovery", pressure=True, ahead_of=EMAIL_QUEUE)


@dataclass(frozen=True)
class InvoiceData:
    """What we keep of a provider invoice, already validated."""

    provider_invoice_id: str
    number: str
    customer_email: str
    customer_name: str
    amount_paid: int
    currency: str
    status: str
    hosted_invoice_url: str
    paid_at: datetime | None


def invoice_record_payment(*, data: InvoiceData, provider_time: datetime) -> Invoice | None:
    """Upsert an invoice from a payment event, inside the caller's transaction.

    Never moves an invoice backwards: an event older than the state already applied changes
    nothing (returns None), and a paid invoice stays paid. When this event is the one that made
    the invoice paid, the intent to email it is written to the outbox in the same transaction.
    An operator's ``recipient_override`` is not the provider's to change, and is kept.
    """
    fields = {
        "number": data.number,
        "customer_email": data.customer_email,
        "customer_name": data.customer_name,
        "amount_paid": data.amount_paid,
        "currency": data.currency,
        "status": data.status,
        "hosted_invoice_url": data.hosted_invoice_url,
        "paid_at": data.paid_at,
        "provider_updated_at": provider_time,
    }
    invoice = Invoice(provider_invoice_id=data.provider_invoice_id, **fields)
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
    # The rest of the request's lines, and the email job it publishes, carry the invoice.
    log_context_bind(invoice_id=invoice.pk)
    if not was_paid and invoice.status == Invoice.Status.PAID:
        outbox_enqueue(task=SEND_INVOICE_EMAIL_TASK, args=[invoice.pk])
    return invoice


def invoice_email_key(invoice: Invoice) -> str:
    return invoice_email_key_for(invoice.pk)


def invoice_email_key_for(invoice_id: int) -> str:
    return f"invoice_email_sent:{invoice_id}"


def invoice_email_message_id(invoice: Invoice, key: str) -> str:
    """A Message-ID derived from the invoice and the key alone: every send of one email,
    including a duplicate after a crash, carries the same one."""
    provider = re.sub(r"[^A-Za-z0-9_.-]", "", invoice.provider_invoice_id)[:64] or "invoice"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"<{provider}.{digest}@{mail.message_id_domain()}>"


# Whose claim a claim may take over: one whose owner is gone (its heartbeat lapsed).
_OWNER_GONE = owner_lapsed_sql(owner="d.claimed_by", since="d.updated_at")

# ``email_claim``'s statement: the claim's row, token, Message-ID and take-over flag, or no row
# when it was not claimed. Of a key it claims only a key pending or failed, a claim whose lease
# has expired or whose owner is gone. A new key records the Message-ID it is given; a claimed
# one keeps its own, so every send of the key carries the one it recorded first.
_CLAIM_SQL = f"""
INSERT INTO {EmailDelivery._meta.db_table} AS d
    (key, invoice_id, state, attempts, claimed_by, lease_expires_at, message_id,
     last_error, requested_by, created_at, updated_at)
VALUES (%(key)s, %(invoice_id)s, 'sending', 1, %(owner)s,
        now() + make_interval(secs => %(lease)s), %(message_id)s, '', '', now(), now())
ON CONFLICT (key) DO UPDATE
    SET state = 'sending', attempts = d.attempts + 1, claimed_by = EXCLUDED.claimed_by,
        lease_expires_at = EXCLUDED.lease_expires_at, updated_at = now()
    WHERE d.state IN ('pending', 'failed')
       OR (d.state = 'sending' AND d.lease_expires_at < now())
       OR (d.state = 'sending' AND {_OWNER_GONE})
RETURNING d.id, d.attempts, d.message_id, (d.xmax <> 0) AS reclaimed
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate


@dataclass(frozen=True)
class Claim:
    """A claim held: its row, its token (``attempts``, which every claim of the row raises),
    the Message-ID to send, and its owner (``claimed_by``)."""

    delivery_id: int
    attempts: int
    message_id: str
    owner: str

    def held(self) -> QuerySet[EmailDelivery]:
        """The row while this very claim is on it: the fence of every write its owner makes
        after the claim. A claim taken over since (by a redelivered message or a rescue, once
        the owner's lease expired or its heartbeat lapsed) has another token, so the owner's
        late writes match nothing."""
        return EmailDelivery.objects.filter(
            pk=self.delivery_id, claimed_by=self.owner, attempts=self.attempts
        )


class ClaimRead(NamedTuple):
    """What ``email_claim`` read and took: the invoice, and the claim (None if not taken)."""

    invoice: Invoice
    claim: Claim | None


def _invoice_read(invoice_id: int) -> Invoice:
    """The invoice an email job names; ``PermanentError`` if there is none (no retry finds it)."""
    try:
        return Invoice.objects.get(pk=invoice_id)
    except Invoice.DoesNotExist:
        raise PermanentError(f"invoice {invoice_id} does not exist") from None


def email_claim(*, invoice_id: int, key: str, owner: str) -> ClaimRead:
    """Read the invoice ``invoice_id``, then claim the right to send its email under ``key``.
    The claim is None if the invoice is not paid, or the key is sent or held by a live claim.
    Raises ``PermanentError`` if there is no such invoice.

    One statement, enforced by the UNIQUE key: no check-then-insert window. A paid invoice
    stays paid (``invoice_record_payment``), so the status read before the claim still holds
    under it."""
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


def _claim_release(claim: Claim, *, error: str) -> None:
    claim.held().filter(state=EmailDelivery.State.SENDING).update(
        state=EmailDelivery.State.FAILED, lease_expires_at=None, last_error=error[:2000]
    )


def _claim_mark_sent(claim: Claim) -> bool:
    """Mark the key sent, if this claim is still the row's; False if it was taken over (the
    message went out anyway: the one duplicate, with the same Message-ID). A claim a rescue
    released and nobody has claimed again is still this one, and the truth is that it was
    sent: marking it so spares the re-enqueued message a second send.

    The message is already accepted, so a database blip here is waited out (about 6 s) rather
    than turned into a retry that could send a duplicate."""
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
    """The circuit breaker on the email provider, shared by every worker; built from the
    settings as they are now (tests and operators change them at run time)."""
    return Breaker(
        "email",
        threshold=settings.EMAIL_BREAKER_FAILURE_THRESHOLD,
        reset_seconds=settings.EMAIL_BREAKER_RESET_SECONDS,
        # A probe whose worker died frees the probe once the task's hard limit has passed.
        probe_ttl_seconds=settings.EMAIL_TASK_TIME_LIMIT + 10,
        # One Redis read per window while it is closed, not two round trips per email.
        check_seconds=BREAKER_CHECK_SECONDS,
    )


def _provider_unavailable(retry_in: float) -> ProviderUnavailable:
    return ProviderUnavailable(
        f"email provider circuit open; next try in {retry_in:.1f} s",
        retry_in=retry_in,
        jitter=settings.EMAIL_BREAKER_RESET_SECONDS,
        deadline=settings.EMAIL_PROVIDER_DEADLINE_SECONDS,
    )


def _deliver(message: EmailMultiAlternatives, *, breaker: Breaker, decision: Decision) -> None:
    """``mail.deliver``, its outcome told to the breaker. Only the provider not answering
    (``Unreachable``: refused, reset, timed out, or a 421) counts against it; a reply about
    this message or mailbox, a 4xx deferral (451) as much as a 5xx refusal, is the provider
    answering, which proves it up, so it counts as a success. (Counting 451s opened the breaker
    a few times in every chaos run, whose SMTP server defers one message in five: with nine
    sends at once, five deferrals in a row are common, and each opening held every email back
    for up to two cool-downs.)

    A failed probe re-opens the breaker and is deferred like the jobs it probed for, not
    retried: it tested the provider on everyone's behalf, and charging its attempt would let
    a long outage exhaust whichever jobs happen to draw the probes."""
    try:
        mail.deliver(message)
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
    """Send the paid-invoice email for ``invoice_id`` at most once under ``key`` (the payment
    email's ``invoice_email_sent`` key unless a resend names its own). Returns what happened:
    ``sent``, ``not_paid``, or ``skipped`` (already sent, or another worker holds the claim).

    Raises ``TransientError`` (retry), ``PermanentError`` (dead-letter) or
    ``ProviderUnavailable`` (the provider's breaker is open: defer, no attempt spent)."""
    log_context_bind(invoice_id=invoice_id)
    # Asked before the claim, so a deferred job holds no claim.
    breaker = email_breaker()
    decision = breaker.allow()
    try:
        if not decision.allowed:
            # Deferred only if there is an email to send: a job for an invoice gone or unpaid
            # ends now, as it would with the breaker closed.
            if _invoice_read(invoice_id).status != Invoice.Status.PAID:
                return _not_paid(invoice_id)
            raise _provider_unavailable(decision.retry_in)
        return _invoice_email_send_claimed(
            invoice_id=invoice_id,
            key=key or invoice_email_key_for(invoice_id),
            owner=owner,
            breaker=breaker,
            decision=decision,
        )
    finally:
        # A probe that never reached the provider (already sent, bad address, database error)
        # gives the probe back at once; after it recorded an outcome this is a no-op.
        breaker.release_probe(decision)


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
    # Built under the claim, from the invoice the claim read: a process stopped here (SIGSTOP,
    # a long pause) past the lapse, and resumed once another took the claim over, sends the one
    # duplicate with the same Message-ID, as one stopped inside its send does.
    try:
        built = mail.invoice_email_build(invoice=invoice, message_id=claim.message_id)
        _deliver(built, breaker=breaker, decision=decision)
    except Exception as exc:
        # Release the claim whatever failed, so the retry (or a replay) can claim it again.
        # Our own errors are already in words; anything else keeps its class.
        words = isinstance(exc, (PermanentError, TransientError))
        _claim_release(claim, error=str(exc) if words else repr(exc))
        raise
    marked = _claim_mark_sent(claim)
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
    """The key of the resend of ``invoice_id`` asked for under ``idempotency_key``."""
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
    return f"invoice_email_resend:{invoice_id}:{digest}"


def _user_key(user: AbstractBaseUser | AnonymousUser, idempotency_key: str) -> str:
    """An email's idempotency key derived from a user's own: unique per user and key."""
    return f"user:{user.pk}:{idempotency_key}"


def invoice_email_resend_request(
    *, invoice_id: int, idempotency_key: str, actor: str
) -> ResendRequest:
    """Ask for a deliberate new email for a paid invoice, under a key of its own
    (``invoice_email_resend:<invoice>:<hash of the idempotency key>``): the same idempotency
    key again finds the first request and sends nothing more; the payment email's key is never
    touched. A new request is recorded as an operator action of ``actor`` (a repeated one is the
    same request, and is not). Raises ``Invoice.DoesNotExist``, or ``ValueError`` for an unpaid
    invoice."""
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


def invoice_recipient_correct(*, invoice_id: int, email: str, reason: str, actor: str) -> Invoice:
    """Send this invoice's emails to ``email`` from now on, instead of the address the
    provider gave (an empty ``email`` removes the correction). The correction is kept in
    ``recipient_override``, apart from the provider's ``customer_email``, so the provider's
    next event for the invoice does not undo it. Recorded, with ``reason`` and the values before
    and after, as an operator action of ``actor``. Sends nothing: replay the dead letter or
    resend the email once it is corrected.

    Raises ``Invoice.DoesNotExist``, or ``ValueError`` with the reason for an invalid address,
    a missing reason, or a correction that changes nothing."""
    email = email.strip()
    reason = " ".join(reason.split())
    if email:
        try:
            # The rules the email itself will be sent under, so a correction that passes here
            # is one the send accepts.
            mail.recipient_address(email=email, name="")
        except PermanentError as exc:
            raise ValueError(f"{email!r} is not a valid email address: {exc}") from exc
    if not reason:
        raise ValueError("say why the recipient is corrected")
    with transaction.atomic():
        # Under the row lock a payment event takes too: the two never interleave.
        invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
        if email == invoice.recipient_override:
            raise ValueError(
                f"the recipient is already {email}" if email else "there is no correction to remove"
            )
        before = _recipient_state(invoice)
        invoice.recipient_override = email
        # Only this field: the provider's fields are the provider's.
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


def invoice_email_resend_request_once(
    *,
    invoice_id: int,
    user: AbstractBaseUser | AnonymousUser,
    idempotency_key: str,
    fingerprint: str,
    request: str,
) -> ResendRequest:
    """The API's resend: ``invoice_email_resend_request`` done once per (``user``,
    ``idempotency_key``), the key scoped to the user as Stripe scopes keys to an account
    (``asyncwork.idempotency``). The same key and request again returns the first request's
    delivery and sends nothing more; the same key for a different request (another invoice)
    raises ``IdempotencyKeyReused``; another user's same key is a request of its own. Raises
    ``Invoice.DoesNotExist`` or ``ValueError`` like ``invoice_email_resend_request`` (the key
    stays unused then)."""
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
    """The admin's bulk resend: ``invoice_email_resend_request`` for each invoice of a
    selection, all in one transaction, done once per (``user``, ``idempotency_key``) in the
    store the API's resend uses (``asyncwork.idempotency``). The same key and selection again
    (a double submit, concurrent or later) sends nothing more and says what the first one
    requested; the same key for another selection raises ``IdempotencyKeyReused``. Invoices
    that are not paid, or gone, are skipped; the key is used even if every one was."""
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
