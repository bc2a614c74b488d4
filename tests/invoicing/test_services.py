"""``invoice_recipient_correct``: the operator's correction of where an invoice's emails go,
validated, recorded with its before and after, kept apart from the provider's address, and
serialised with the provider's events on the invoice's row lock, so neither undoes the other."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from asyncwork.contrib.operators.models import OperatorAction
from invoicing.models import Invoice
from invoicing.services import InvoiceData, invoice_recipient_correct, invoice_record_payment
from tests.helpers.factories import paid_invoice

pytestmark = pytest.mark.django_db(transaction=True)


def provider_event(invoice: Invoice, *, customer_email: str) -> InvoiceData:
    return InvoiceData(
        provider_invoice_id=invoice.provider_invoice_id,
        number=invoice.number,
        customer_email=customer_email,
        provider_customer_id="",
        customer_name="",
        amount_paid=invoice.amount_paid,
        currency=invoice.currency,
        status="paid",
        hosted_invoice_url="",
        paid_at=invoice.paid_at,
    )


@pytest.mark.parametrize(
    ("email", "reason", "error"),
    [
        ("not an address", "typo", "'not an address' is not a valid email address"),
        ("a@example.com\r\nBcc: b@example.com", "typo", "is not a valid email address"),
        (f"{'a' * 310}@example.com", "typo", "is not a valid email address"),
        ("right@example.com", " \n ", "say why the recipient is corrected"),
        ("", "undo", "there is no correction to remove"),
    ],
)
def test_bad_corrections_are_refused_with_a_reason_and_change_nothing(
    email: str, reason: str, error: str
) -> None:
    invoice = paid_invoice()
    with pytest.raises(ValueError, match=error):
        invoice_recipient_correct(invoice_id=invoice.pk, email=email, reason=reason, actor="t")
    invoice.refresh_from_db()
    assert invoice.recipient_override == ""
    assert not OperatorAction.objects.exists()


def test_an_unknown_invoice_is_does_not_exist() -> None:
    with pytest.raises(Invoice.DoesNotExist):
        invoice_recipient_correct(invoice_id=424242, email="a@example.com", reason="x", actor="t")


def test_a_correction_and_a_provider_event_racing_keep_both() -> None:
    """The provider's event holds the invoice's row lock; the correction waits for it, and
    then changes only its own field: the provider's new address and the correction both stand."""
    invoice = paid_invoice(customer_email="old@provider.com")
    locked, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def provider() -> None:
        try:
            with transaction.atomic():
                invoice_record_payment(
                    data=provider_event(invoice, customer_email="new@provider.com"),
                    provider_time=timezone.now() + timedelta(seconds=1),
                )
                locked.set()
                release.wait(20)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def operator() -> None:
        try:
            invoice_recipient_correct(
                invoice_id=invoice.pk, email="right@example.com", reason="typo", actor="admin:op"
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    first = threading.Thread(target=provider)
    first.start()
    assert locked.wait(10)
    second = threading.Thread(target=operator)
    second.start()
    second.join(1)
    waited = second.is_alive()  # blocked on the provider's row lock
    release.set()
    first.join(20)
    second.join(20)

    assert errors == []
    assert waited
    invoice.refresh_from_db()
    assert (invoice.customer_email, invoice.recipient_override, invoice.recipient) == (
        "new@provider.com",
        "right@example.com",
        "right@example.com",
    )
    recorded = OperatorAction.objects.get()
    assert recorded.before == {"recipient_override": "", "recipient": "new@provider.com"}
