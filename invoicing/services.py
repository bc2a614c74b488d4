"""The invoicing app's services: a payment event applied (the invoice recorded and its email
enqueued in the same transaction, never moving it backwards), an open invoice made locally, a
deliberate resend, a recipient corrected. What sending an email holds to, and its tasks, are
``invoicing.tasks``'s.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.utils import timezone

from asyncwork.audit import operator_action_record
from asyncwork.contrib.idempotency import Performed, idempotent_perform
from asyncwork.db import insert_or_skip
from asyncwork.errors import PermanentError
from asyncwork.logging import log_context_bind
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import (
    invoice_email_message_id,
    recipient_address,
    resend_invoice_email,
    send_invoice_email,
)
from webhooks.stripe import (
    Event,
    WebhookRejected,
    field_epoch,
    field_int,
    field_text,
    name_valid,
    webhook_handler,
)

logger = logging.getLogger(__name__)


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
        send_invoice_email.enqueue(invoice.pk)
    return invoice


# The webhook events invoicing acts on (``webhooks.stripe.webhook_handler``). Free-text fields are
# made storable rather than refused, so a customer's typo never costs the payment its record or
# receipt.
PAYMENT_EVENT_TYPES = ("invoice.paid", "invoice.payment_succeeded")


def invoice_parse(obj: Any) -> InvoiceData:
    """``data.object`` as the invoice we keep; ``WebhookRejected`` (400) if we cannot key on it."""
    if not isinstance(obj, dict):
        raise WebhookRejected("data.object is missing")
    invoice_id = obj.get("id")
    if invoice_id is None or invoice_id == "":
        raise WebhookRejected("data.object.id is missing")
    if not name_valid(invoice_id):
        raise WebhookRejected("data.object.id is malformed")
    currency = field_text(obj, "currency", limit=3).lower()
    if currency and not re.fullmatch(r"[a-z]{3}", currency):
        raise WebhookRejected("data.object.currency is not a 3-letter code")
    transitions = obj.get("status_transitions")
    paid_at = field_epoch(transitions, "paid_at") if isinstance(transitions, dict) else None
    status = field_text(obj, "status", limit=20) or "paid"
    if status not in {"draft", "open", "paid", "uncollectible", "void"}:
        raise WebhookRejected("data.object.status is not an invoice status")
    return InvoiceData(
        provider_invoice_id=invoice_id,
        number=field_text(obj, "number", limit=255),
        customer_email=field_text(obj, "customer_email", limit=320),
        provider_customer_id=field_text(obj, "customer", limit=255),
        customer_name=field_text(obj, "customer_name", limit=255),
        amount_paid=field_int(obj, "amount_paid") or 0,
        currency=currency,
        status=status,
        hosted_invoice_url=field_text(obj, "hosted_invoice_url", limit=2000),
        paid_at=paid_at,
    )


@webhook_handler(*PAYMENT_EVENT_TYPES, parse=invoice_parse)
def invoice_payment_apply(data: InvoiceData, event: Event) -> None:
    invoice = invoice_record_payment(data=data, provider_time=event.created)
    logger.info(
        "payment event applied",
        extra={
            "event_id": event.id,
            "event_type": event.type,
            "invoice_id": invoice.pk if invoice else None,
            "stale": invoice is None,
        },
    )


def invoice_open(
    *, provider_invoice_id: str, customer_email: str, customer_name: str, amount: int, currency: str
) -> Invoice:
    """An open invoice, as the provider's events would have stored it before its payment: what a
    webhook handler of a later event (``invoice.voided``, ``invoice.paid``) acts on, when trying
    one locally. Its provider time is now to the second, a Stripe event's resolution, so an event
    created from now on is not older than it. ``ValueError`` for an address the send would refuse
    or a currency that is not a 3-letter code."""
    try:
        recipient_address(email=customer_email, name=customer_name)
    except PermanentError as exc:
        raise ValueError(f"{customer_email!r} is not a valid email address: {exc}") from exc
    if not re.fullmatch(r"[a-zA-Z]{3}", currency):
        raise ValueError(f"{currency!r} is not a 3-letter currency code")
    return Invoice.objects.create(
        provider_invoice_id=provider_invoice_id,
        customer_email=customer_email,
        customer_name=customer_name,
        amount_paid=amount,
        currency=currency.lower(),
        status=Invoice.Status.OPEN,
        provider_updated_at=timezone.now().replace(microsecond=0),
    )


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
            resend_invoice_email.enqueue(delivery.pk)
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
            recipient_address(email=email, name="")
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
    """The API's resend: ``invoice_email_resend_request`` once per (``user``, ``idempotency_key``)
    (``asyncwork.contrib.idempotency``). The same key and request returns the first delivery; the
    same key for another invoice raises ``IdempotencyKeyReused``. Raises like
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
