"""This app's dead letters to the machinery: the invoice each is about and what became of its
email (``describer``), read in one query per page, one whose invoice is gone left
undescribed; and the replay check (``replay_check``): a letter that failed on its
recipient's address is refused a replay while the address is the one that failed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import OuterRef, Subquery
from django.urls import reverse
from django.utils.module_loading import import_string

from asyncwork import deadletters
from asyncwork.contrib.mail import RecipientRejected
from asyncwork.deadletters import Subject
from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import payment_emails, resend_invoice_email, send_invoice_email

_INVOICE_FIELDS = ("pk", "number", "provider_invoice_id", "customer_email", "recipient_override")
_SEND_FIELDS = ("state", "recipient", "sent_at", "bounced_at")
_DELIVERY_FIELDS = ("pk", "key", "invoice", *_SEND_FIELDS)
_FAILED_ON_ADDRESS = (EmailDelivery.State.FAILED, EmailDelivery.State.BOUNCED)


def _id_argument(letter: DeadLetter) -> int | None:
    """The row id the job takes as its one argument, if that is what it stored."""
    args: Any = letter.args
    if isinstance(args, list) and args and type(args[0]) is int:
        return int(args[0])
    return None


def email_outcome(delivery: EmailDelivery | None) -> str:
    """What became of an email, in words: sent (when, to whom), bounced, failed, or waiting."""
    if delivery is None:
        return "no email attempted yet"
    to = f" to {delivery.recipient}" if delivery.recipient else ""
    if delivery.state == EmailDelivery.State.SENT and delivery.sent_at is not None:
        return f"email sent {delivery.sent_at:%Y-%m-%d %H:%M} UTC{to}"
    if delivery.state == EmailDelivery.State.BOUNCED and delivery.bounced_at is not None:
        return f"email bounced {delivery.bounced_at:%Y-%m-%d %H:%M} UTC{to}"
    waiting: dict[str, str] = {
        EmailDelivery.State.PENDING: "email waiting to be sent",
        EmailDelivery.State.SENDING: "email being sent",
        EmailDelivery.State.FAILED: f"email not sent{to}: its last attempt failed",
    }
    return waiting.get(delivery.state, f"email {delivery.state}")


def invoice_subject(invoice: Invoice, *, delivery: EmailDelivery | None, note: str = "") -> Subject:
    return Subject(
        kind="invoice",
        label=f"{invoice} ({note})" if note else str(invoice),
        recipient=invoice.recipient,
        url=reverse("admin:invoicing_invoice_change", args=[invoice.pk]),
        outcome=email_outcome(delivery),
    )


def _letters_deliveries(
    letters: Sequence[DeadLetter], *, resend: bool
) -> dict[int, tuple[Invoice, EmailDelivery | None]]:
    """Each letter's invoice and email delivery, by letter pk, in one query: a send names its
    invoice (its delivery, read as far as a subject needs, is its payment email), a resend
    its delivery."""
    wanted = {letter.pk: _id_argument(letter) for letter in letters}
    ids = {pk for pk in wanted.values() if pk is not None}
    fields = (*_DELIVERY_FIELDS, *(f"invoice__{name}" for name in _INVOICE_FIELDS if name != "pk"))
    found: dict[int, tuple[Invoice, EmailDelivery | None]] = {}
    if resend:
        deliveries = EmailDelivery.objects.select_related("invoice").only(*fields).in_bulk(ids)
        for letter_pk, delivery_pk in wanted.items():
            if delivery_pk in deliveries:
                delivery = deliveries[delivery_pk]
                found[letter_pk] = (delivery.invoice, delivery)
        return found
    # The payment email's delivery read beside its invoice, in the same statement.
    send = payment_emails().filter(invoice=OuterRef("pk"))
    invoices = (
        Invoice.objects.only(*_INVOICE_FIELDS)
        .annotate(**{f"email_{name}": Subquery(send.values(name)[:1]) for name in _SEND_FIELDS})
        .in_bulk(ids)
    )
    for letter_pk, invoice_pk in wanted.items():
        if invoice_pk in invoices:
            invoice = invoices[invoice_pk]
            read = {name: getattr(invoice, f"email_{name}") for name in _SEND_FIELDS}
            send_read = EmailDelivery(invoice=invoice, **read) if read["state"] else None
            found[letter_pk] = (invoice, send_read)
    return found


@deadletters.describer(send_invoice_email)
def send_dead_letter_subjects(letters: Sequence[DeadLetter]) -> dict[int, Subject]:
    """Dead letters of the payment email (``send_invoice_email(invoice_id)``)."""
    return {
        pk: invoice_subject(invoice, delivery=delivery)
        for pk, (invoice, delivery) in _letters_deliveries(letters, resend=False).items()
    }


@deadletters.describer(resend_invoice_email)
def resend_dead_letter_subjects(letters: Sequence[DeadLetter]) -> dict[int, Subject]:
    """Dead letters of a resend (``resend_invoice_email(delivery_id)``)."""
    return {
        pk: invoice_subject(invoice, delivery=delivery, note="resend")
        for pk, (invoice, delivery) in _letters_deliveries(letters, resend=True).items()
    }


def _failed_on_address(letter: DeadLetter) -> bool:
    """Whether the letter's failure is a ``RecipientRejected``: the class its path names, under
    any path the class is importable by (``invoicing.tasks`` imports it too); a path that no
    longer imports (a letter kept from an earlier layout: ``invoicing.mail.RecipientRejected``)
    by the class's name."""
    try:
        failure = import_string(letter.exception_class)
    except ImportError:
        return letter.exception_class.rpartition(".")[2] == RecipientRejected.__name__
    return isinstance(failure, type) and issubclass(failure, RecipientRejected)


def _address_unchanged(letters: Sequence[DeadLetter], *, resend: bool) -> dict[int, str]:
    failed_on_address = [x for x in letters if _failed_on_address(x)]
    refusals: dict[int, str] = {}
    for pk, (invoice, delivery) in _letters_deliveries(failed_on_address, resend=resend).items():
        if delivery is not None and delivery.state not in _FAILED_ON_ADDRESS:
            continue  # sent or under way since: a replay finds it so and does nothing
        tried = delivery.recipient if delivery is not None else ""
        if invoice.recipient == tried:
            refusals[pk] = (
                f"it failed on its recipient address ({tried or 'none'}), which is unchanged: "
                "correct the recipient first"
            )
    return refusals


@deadletters.replay_check(send_invoice_email)
def send_replay_refusals(letters: Sequence[DeadLetter]) -> dict[int, str]:
    return _address_unchanged(letters, resend=False)


@deadletters.replay_check(resend_invoice_email)
def resend_replay_refusals(letters: Sequence[DeadLetter]) -> dict[int, str]:
    return _address_unchanged(letters, resend=True)
