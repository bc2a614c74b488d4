"""The invoices admin: the email's status at a glance, search, and a "Resend invoice email"
action that sends a deliberate new email under its own key and records who asked."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from core.models import OutboxMessage
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import RESEND_INVOICE_EMAIL_TASK, invoice_email_key, invoice_email_send
from tests.changelist import EMPTY, messages, rows, run_action
from tests.smtp import SmtpServer
from tests.workers import worker_thread

pytestmark = pytest.mark.django_db(transaction=True)

INVOICES = "/admin/invoicing/invoice/"


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(
        get_user_model().objects.create_superuser("op", "op@example.com", "pw-12345-long")
    )
    return client


def invoice(number: str, *, status: str = "paid", **fields: Any) -> Invoice:
    return Invoice.objects.create(
        provider_invoice_id=f"in_{number.lower()}",
        number=number,
        customer_email=f"{number.lower()}@example.com",
        customer_name="Jenny Rosen",
        amount_paid=2000 if status == "paid" else 0,
        currency="usd",
        status=status,
        paid_at=timezone.now() if status == "paid" else None,
        provider_updated_at=timezone.now(),
        **fields,
    )


def test_list_search_filter_and_detail(staff: Client, smtp: SmtpServer) -> None:
    sent, pending, unpaid = invoice("INV-1"), invoice("INV-2"), invoice("INV-3", status="open")
    assert invoice_email_send(invoice_id=sent.pk, owner="test") == "sent"

    listed = {row["number"]: row for row in rows(staff.get(INVOICES))}
    assert listed["INV-1"]["customer_email"] == "inv-1@example.com"
    assert listed["INV-1"]["amount"] == "20.00 USD"
    assert (listed["INV-1"]["status"], listed["INV-1"]["email_status_display"]) == ("Paid", "sent")
    assert listed["INV-1"]["email_when"] != EMPTY
    assert (listed["INV-2"]["email_status_display"], listed["INV-2"]["email_when"]) == (
        "pending",
        EMPTY,
    )
    assert listed["INV-3"]["email_status_display"] == "none"
    for query in ("INV-2", "inv-2@example.com", "in_inv-2"):
        assert [r["number"] for r in rows(staff.get(INVOICES, {"q": query}))] == ["INV-2"]
    by_status = rows(staff.get(INVOICES, {"email_status": "sent"}))
    assert [r["number"] for r in by_status] == ["INV-1"]

    detail = staff.get(f"{INVOICES}{sent.pk}/change/")
    assert detail.status_code == 200
    assert invoice_email_key(sent).encode() in detail.content  # the deliveries inline
    assert pending.pk != unpaid.pk


def test_resend_sends_a_new_email_under_its_own_key_and_records_who_asked(
    staff: Client, smtp: SmtpServer
) -> None:
    paid, unpaid = invoice("INV-10"), invoice("INV-11", status="open")
    assert invoice_email_send(invoice_id=paid.pk, owner="payment") == "sent"
    payment = EmailDelivery.objects.get(key=invoice_email_key(paid))
    asked_at = timezone.now()

    with worker_thread():
        response = run_action(staff, INVOICES, "resend_email", [paid.pk, unpaid.pk])
        smtp.handler.wait_for(2, timeout=20)
        again = run_action(staff, INVOICES, "resend_email", [paid.pk])  # a second click
        smtp.handler.wait_for(3, timeout=20)
        time.sleep(1)

    assert messages(response) == [
        ("success", "Requested 1 invoice email resend(s)."),
        ("warning", "Skipped 1 unpaid invoice(s): INV-11."),
    ]
    assert messages(again) == [("success", "Requested 1 invoice email resend(s).")]
    resends = list(EmailDelivery.objects.exclude(pk=payment.pk).order_by("pk"))
    assert len(resends) == 2  # each click is a deliberate new email
    for resend in resends:
        assert resend.key.startswith(f"invoice_email_resend:{paid.pk}:")
        assert resend.invoice_id == paid.pk
        assert resend.requested_by == "admin:op"
        assert resend.created_at >= asked_at
        assert resend.state == "sent"
    assert resends[0].key != resends[1].key
    assert list(
        OutboxMessage.objects.filter(task=RESEND_INVOICE_EMAIL_TASK).values_list("args", flat=True)
    ) == [[r.pk] for r in resends]
    assert len(smtp.messages) == 3  # the payment email and the two resends
    assert len({m["Message-ID"] for m in smtp.messages}) == 3
    untouched = EmailDelivery.objects.get(pk=payment.pk)
    assert (untouched.state, untouched.attempts, untouched.sent_at, untouched.updated_at) == (
        payment.state,
        payment.attempts,
        payment.sent_at,
        payment.updated_at,
    )
    assert not unpaid.emails.exists()

    detail = staff.get(f"{INVOICES}{paid.pk}/change/")
    assert detail.content.count(b"admin:op") == 2  # who asked, on the invoice's deliveries
