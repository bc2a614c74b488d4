"""A deliberate resend: its own idempotency key, never the payment email's; the same
Idempotency-Key twice sends once, a new one sends again."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from invoicing.models import EmailDelivery, Invoice
from invoicing.services import invoice_email_key, invoice_email_send
from tests.factories import staff_user
from tests.smtp import SmtpServer
from tests.workers import worker_thread

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff() -> APIClient:
    client = APIClient()
    client.force_authenticate(staff_user("op", groups=["operators"]))
    return client


def paid_invoice(status: str = "paid") -> Invoice:
    return Invoice.objects.create(
        provider_invoice_id="in_resend",
        number="INV-R",
        customer_email="r@example.com",
        status=status,
        provider_updated_at=timezone.now(),
    )


def test_same_key_twice_sends_once_and_a_new_key_sends_again(
    staff: APIClient, smtp: SmtpServer
) -> None:
    invoice = paid_invoice()
    assert invoice_email_send(invoice_id=invoice.pk, owner="payment") == "sent"
    url = f"/api/invoices/{invoice.pk}/resend-email/"
    with worker_thread():
        first = staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-123")
        again = staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-123")
        smtp.handler.wait_for(2, timeout=20)
        other = staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-456")
        smtp.handler.wait_for(3, timeout=20)
        time.sleep(1)

    assert (first.status_code, again.status_code, other.status_code) == (202, 202, 202)
    assert again.json() == first.json()  # the first response, nothing more sent
    assert other.json()["delivery_id"] != first.json()["delivery_id"]
    assert first.json()["requested_by"] == "api:op"
    assert len(smtp.messages) == 3  # the payment email and two deliberate resends
    ids = [m["Message-ID"] for m in smtp.messages]
    assert len(set(ids)) == 3  # each email under its own key has its own Message-ID
    payment = EmailDelivery.objects.get(key=invoice_email_key(invoice))
    assert (payment.state, payment.attempts) == ("sent", 1)  # never bypassed or reset
    resends = EmailDelivery.objects.exclude(pk=payment.pk)
    assert sorted(resends.values_list("state", flat=True)) == ["sent", "sent"]


def test_missing_or_oversized_key_is_400_and_unpaid_is_409(staff: APIClient) -> None:
    invoice = paid_invoice()
    url = f"/api/invoices/{invoice.pk}/resend-email/"
    missing = staff.post(url)
    assert missing.status_code == 400
    assert "Idempotency-Key" in missing.json()
    assert staff.post(url, HTTP_IDEMPOTENCY_KEY="k" * 256).status_code == 400
    Invoice.objects.filter(pk=invoice.pk).update(status="open")
    assert staff.post(url, HTTP_IDEMPOTENCY_KEY="x").status_code == 409
    assert (
        staff.post("/api/invoices/999999/resend-email/", HTTP_IDEMPOTENCY_KEY="x").status_code
        == 404
    )
    assert not EmailDelivery.objects.exists()
