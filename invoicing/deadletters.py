"""The invoice each of this app's dead letters is about (``dead_letter_describer``), read in one
query per page; one whose invoice is gone is left undescribed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.urls import reverse

from asyncwork.deadletters import Subject, dead_letter_describer
from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import RESEND_INVOICE_EMAIL_TASK, SEND_INVOICE_EMAIL_TASK

_INVOICE_FIELDS = ("pk", "number", "provider_invoice_id", "customer_email", "recipient_override")


def _id_argument(letter: DeadLetter) -> int | None:
    """The row id the job takes as its one argument, if that is what it stored."""
    args: Any = letter.args
    if isinstance(args, list) and args and type(args[0]) is int:
        return int(args[0])
    return None


def invoice_subject(invoice: Invoice, *, note: str = "") -> Subject:
    return Subject(
        kind="invoice",
        label=f"{invoice} ({note})" if note else str(invoice),
        recipient=invoice.recipient,
        url=reverse("admin:invoicing_invoice_change", args=[invoice.pk]),
    )


@dead_letter_describer(SEND_INVOICE_EMAIL_TASK)
def send_dead_letter_subjects(letters: Sequence[DeadLetter]) -> dict[int, Subject]:
    """Dead letters of the payment email (``send_invoice_email(invoice_id)``)."""
    wanted = {letter.pk: _id_argument(letter) for letter in letters}
    invoices = Invoice.objects.only(*_INVOICE_FIELDS).in_bulk(
        {pk for pk in wanted.values() if pk is not None}
    )
    return {
        letter_pk: invoice_subject(invoices[invoice_pk])
        for letter_pk, invoice_pk in wanted.items()
        if invoice_pk in invoices
    }


@dead_letter_describer(RESEND_INVOICE_EMAIL_TASK)
def resend_dead_letter_subjects(letters: Sequence[DeadLetter]) -> dict[int, Subject]:
    """Dead letters of a resend (``resend_invoice_email(delivery_id)``)."""
    wanted = {letter.pk: _id_argument(letter) for letter in letters}
    deliveries = (
        EmailDelivery.objects.select_related("invoice")
        .only("pk", "invoice", *(f"invoice__{name}" for name in _INVOICE_FIELDS if name != "pk"))
        .in_bulk({pk for pk in wanted.values() if pk is not None})
    )
    return {
        letter_pk: invoice_subject(deliveries[delivery_pk].invoice, note="resend")
        for letter_pk, delivery_pk in wanted.items()
        if delivery_pk in deliveries
    }
