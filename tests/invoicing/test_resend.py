"""A deliberate resend: its own idempotency key, never the payment email's; the same
Idempotency-Key twice sends once, a new one sends again. Keys are the caller's own: the same
key for another request is 422, another user's same key is a request of its own, racing
requests under one key create one email, and a retry says what the first request did now."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connections
from django.utils import timezone
from rest_framework.test import APIClient

from asyncwork.models import DeadLetter, IdempotencyRecord, Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import invoice_email_key, invoice_email_send
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.database import lock_waiters
from tests.helpers.factories import paid_invoice as new_paid_invoice
from tests.helpers.factories import staff_user
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet

pytestmark = pytest.mark.django_db(transaction=True)


def as_staff(username: str) -> APIClient:
    """An API client of an operator (a staff user in the "operators" group)."""
    client = APIClient()
    user = get_user_model().objects.filter(username=username).first()
    client.force_authenticate(user or staff_user(username, groups=["operators"]))
    return client


def resend_url(invoice: Invoice) -> str:
    return f"/api/invoices/{invoice.pk}/resend-email/"


def same_request(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same email request, whatever happened to it since."""
    moving = {"status", "attempts", "sent_at"}
    return {k: v for k, v in a.items() if k not in moving} == {
        k: v for k, v in b.items() if k not in moving
    }


def paid_invoice(status: str = "paid") -> Invoice:
    return Invoice.objects.create(
        provider_invoice_id="in_resend",
        number="INV-R",
        customer_email="r@example.com",
        status=status,
        provider_updated_at=timezone.now(),
    )


def test_same_key_twice_sends_once_and_a_new_key_sends_again(
    api_staff: APIClient, smtp: SmtpServer
) -> None:
    invoice = paid_invoice()
    assert invoice_email_send(invoice_id=invoice.pk, owner="payment") == "sent"
    url = f"/api/invoices/{invoice.pk}/resend-email/"
    with worker_thread():
        first = api_staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-123")
        again = api_staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-123")
        smtp.handler.wait_for(2, timeout=20)
        other = api_staff.post(url, HTTP_IDEMPOTENCY_KEY="ticket-456")
        smtp.handler.wait_for(3, timeout=20)
        pipeline_quiet()

    assert (first.status_code, again.status_code, other.status_code) == (202, 202, 202)
    # The first response, nothing more sent (its status may have moved on: see below).
    assert same_request(again.json(), first.json())
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert "Idempotent-Replayed" not in other
    assert other.json()["delivery_id"] != first.json()["delivery_id"]
    assert first.json()["requested_by"] == "api:op"
    assert len(smtp.messages) == 3  # the payment email and two deliberate resends
    ids = [m["Message-ID"] for m in smtp.messages]
    assert len(set(ids)) == 3  # each email under its own key has its own Message-ID
    payment = EmailDelivery.objects.get(key=invoice_email_key(invoice.pk))
    assert (payment.state, payment.attempts) == ("sent", 1)  # never bypassed or reset
    resends = EmailDelivery.objects.exclude(pk=payment.pk)
    assert sorted(resends.values_list("state", flat=True)) == ["sent", "sent"]


def test_missing_or_oversized_key_is_400_and_unpaid_is_409(api_staff: APIClient) -> None:
    invoice = paid_invoice()
    url = f"/api/invoices/{invoice.pk}/resend-email/"
    missing = api_staff.post(url)
    assert missing.status_code == 400
    assert "Idempotency-Key" in missing.json()
    assert api_staff.post(url, HTTP_IDEMPOTENCY_KEY="k" * 256).status_code == 400
    nul = api_staff.post(url, HTTP_IDEMPOTENCY_KEY="a\x00b")  # PostgreSQL text refuses NUL
    assert (nul.status_code, nul.json()) == (
        400,
        {"Idempotency-Key": "printable characters only"},
    )
    Invoice.objects.filter(pk=invoice.pk).update(status="open")
    assert api_staff.post(url, HTTP_IDEMPOTENCY_KEY="x").status_code == 409
    assert (
        api_staff.post("/api/invoices/999999/resend-email/", HTTP_IDEMPOTENCY_KEY="x").status_code
        == 404
    )
    assert not EmailDelivery.objects.exists()


def test_the_same_key_for_another_invoice_is_422_and_sends_nothing(api_staff: APIClient) -> None:
    a, b = new_paid_invoice(), new_paid_invoice()
    first = api_staff.post(resend_url(a), HTTP_IDEMPOTENCY_KEY="ticket-9")

    reused = api_staff.post(resend_url(b), HTTP_IDEMPOTENCY_KEY="ticket-9")

    assert first.status_code == 202
    assert reused.status_code == 422
    detail = reused.json()["detail"]
    assert "already used for another request" in detail
    assert f"POST /api/invoices/{a.pk}/resend-email/" in detail
    assert not EmailDelivery.objects.filter(invoice=b).exists()
    # A body makes a different request too.
    with_body = api_staff.post(
        resend_url(a), {"note": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="ticket-9"
    )
    assert with_body.status_code == 422
    assert EmailDelivery.objects.count() == 1


def test_another_user_with_the_same_key_makes_a_request_of_its_own(api_staff: APIClient) -> None:
    invoice = new_paid_invoice()
    mine = api_staff.post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="retry-1")
    theirs = as_staff("colleague").post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="retry-1")
    theirs_again = as_staff("colleague").post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="retry-1")

    assert (mine.status_code, theirs.status_code, theirs_again.status_code) == (202, 202, 202)
    assert mine.json()["delivery_id"] != theirs.json()["delivery_id"]
    assert (mine.json()["requested_by"], theirs.json()["requested_by"]) == (
        "api:op",
        "api:colleague",
    )
    assert theirs_again.json()["delivery_id"] == theirs.json()["delivery_id"]
    assert EmailDelivery.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 2


def test_a_retry_says_what_the_first_request_did_now(
    api_staff: APIClient, smtp: SmtpServer
) -> None:
    delivered = new_paid_invoice()
    refused = new_paid_invoice(customer_email="typo@exmaple.com")
    smtp.handler.faults.refuse = {"typo@exmaple.com"}
    queued = api_staff.post(resend_url(delivered), HTTP_IDEMPOTENCY_KEY="a")
    doomed = api_staff.post(resend_url(refused), HTTP_IDEMPOTENCY_KEY="b")
    assert (queued.json()["status"], doomed.json()["status"]) == ("queued", "queued")
    assert queued.json()["sent_at"] is None

    with worker_thread():
        smtp.handler.wait_for(1, timeout=20)
        assert wait_until(DeadLetter.objects.exists, timeout=20)
        pipeline_quiet()

    sent = api_staff.post(resend_url(delivered), HTTP_IDEMPOTENCY_KEY="a")
    failed = api_staff.post(resend_url(refused), HTTP_IDEMPOTENCY_KEY="b")
    assert (sent.status_code, failed.status_code) == (202, 202)
    assert (sent.json()["status"], sent.json()["attempts"]) == ("sent", 1)
    assert sent.json()["sent_at"] is not None
    assert same_request(sent.json(), queued.json())
    assert failed.json()["status"] == "failed"
    assert DeadLetter.objects.get().args == [failed.json()["delivery_id"]]
    assert len(smtp.messages) == 1  # the retries sent nothing more

    # Replaying the dead letter queues the email again.
    DeadLetter.objects.update(replayed_at=timezone.now())
    again = api_staff.post(resend_url(refused), HTTP_IDEMPOTENCY_KEY="b")
    assert again.json()["status"] == "queued"


def test_an_unpaid_invoice_leaves_the_key_unused(api_staff: APIClient) -> None:
    invoice = new_paid_invoice(status="open")
    assert api_staff.post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="k").status_code == 409
    assert not IdempotencyRecord.objects.exists()
    Invoice.objects.filter(pk=invoice.pk).update(status="paid")
    later = api_staff.post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="k")
    assert later.status_code == 202
    assert "Idempotent-Replayed" not in later


def test_two_requests_racing_with_one_key_create_one_email(api_staff: APIClient) -> None:
    """Two threads post the same (user, key) at once through the API. The first is held in its
    transaction (a lock on the job table) until the second waits on PostgreSQL for the key:
    they overlap, and one email is requested."""
    invoice = new_paid_invoice()
    responses: list[Any] = []

    def post() -> None:
        try:
            responses.append(as_staff("op").post(resend_url(invoice), HTTP_IDEMPOTENCY_KEY="race"))
        finally:
            connections.close_all()

    holder = connections.create_connection("default")
    threads = [threading.Thread(target=post) for _ in range(2)]
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"LOCK TABLE {Job._meta.db_table} IN SHARE MODE")
            for thread in threads:
                thread.start()
            assert wait_until(lambda: lock_waiters() == 2, timeout=20)
            cursor.execute("COMMIT")
        for thread in threads:
            thread.join(30)
    finally:
        holder.close()

    assert [r.status_code for r in responses] == [202, 202]
    assert responses[0].json()["delivery_id"] == responses[1].json()["delivery_id"]
    assert sorted(r.get("Idempotent-Replayed", "") for r in responses) == ["", "true"]
    assert EmailDelivery.objects.filter(invoice=invoice).count() == 1
    assert IdempotencyRecord.objects.count() == 1
