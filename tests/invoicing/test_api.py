"""GET /api/invoices/: staff with the view permission, with the payment email's status and
attempts; POST .../resend-email/ needs the resend permission too, and is recorded."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.models import DeadLetter, Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import send_invoice_email
from tests.helpers.admin import api_as
from tests.helpers.factories import staff_user

pytestmark = pytest.mark.django_db


def invoice(provider_id: str, status: str = "paid") -> Invoice:
    return Invoice.objects.create(
        provider_invoice_id=provider_id,
        number=provider_id,
        customer_email="x@example.com",
        status=status,
        provider_updated_at=timezone.now(),
    )


def test_anonymous_and_non_staff_are_refused() -> None:
    client = APIClient()
    assert client.get("/api/invoices/").status_code in (401, 403)
    client.force_authenticate(get_user_model().objects.create_user("customer"))
    assert client.get("/api/invoices/").status_code == 403


def test_list_and_detail_show_email_status_and_attempts(api_viewer: APIClient) -> None:
    sent, pending, dead, unpaid = (
        invoice("in_a"),
        invoice("in_b"),
        invoice("in_c"),
        invoice("in_d", "open"),
    )
    EmailDelivery.objects.create(
        key=f"invoice_email_sent:{sent.pk}",
        invoice=sent,
        state="sent",
        attempts=2,
        message_id="<a>",
        sent_at=timezone.now(),
    )
    EmailDelivery.objects.create(
        key=f"invoice_email_sent:{dead.pk}",
        invoice=dead,
        state="failed",
        attempts=1,
        message_id="<c>",
    )
    DeadLetter.objects.create(
        task=send_invoice_email.module_path,
        task_id="t1",
        args=[dead.pk],
        queue="email",
        reason="permanent",
        attempts=1,
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )

    body: dict[str, Any] = api_viewer.get("/api/invoices/").json()
    by_id = {row["provider_invoice_id"]: row for row in body["results"]}
    assert body["count"] == 4
    assert (by_id["in_a"]["email_status"], by_id["in_a"]["email_attempts"]) == ("sent", 2)
    assert by_id["in_a"]["email_sent_at"] is not None
    assert (by_id["in_b"]["email_status"], by_id["in_b"]["email_attempts"]) == ("pending", 0)
    assert by_id["in_c"]["email_status"] == "dead_lettered"
    assert by_id["in_d"]["email_status"] == "none"
    detail = api_viewer.get(f"/api/invoices/{sent.pk}/").json()
    assert (detail["id"], detail["email_status"]) == (sent.pk, "sent")
    assert pending.pk
    assert unpaid.pk


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status=paid", {"in_a", "in_b", "in_c"}),
        ("status=open", {"in_d"}),
        ("email_status=sent", {"in_a"}),
        ("email_status=pending", {"in_b", "in_c"}),
        ("email_status=none", {"in_d"}),
    ],
)
def test_filters(api_viewer: APIClient, query: str, expected: set[str]) -> None:
    a = invoice("in_a")
    invoice("in_b")
    invoice("in_c")
    invoice("in_d", "open")
    EmailDelivery.objects.create(
        key=f"invoice_email_sent:{a.pk}", invoice=a, state="sent", message_id="<a>"
    )
    rows = api_viewer.get(f"/api/invoices/?{query}").json()["results"]
    assert {row["provider_invoice_id"] for row in rows} == expected


@pytest.mark.parametrize("query", ["status=bogus", "email_status=bogus"])
def test_bad_filters_are_400_with_a_reason(api_viewer: APIClient, query: str) -> None:
    response = api_viewer.get(f"/api/invoices/?{query}")
    assert response.status_code == 400
    assert "one of" in str(response.json())


def test_unknown_invoice_is_404(api_viewer: APIClient) -> None:
    assert api_viewer.get("/api/invoices/999999/").status_code == 404


def test_resend_needs_its_permission_and_is_recorded_once() -> None:
    paid = invoice("in_r")
    url = f"/api/invoices/{paid.pk}/resend-email/"
    viewer = api_as(staff_user("watcher", groups=["viewers"]))
    operator = api_as(staff_user("op", groups=["operators"]))

    assert viewer.get(f"/api/invoices/{paid.pk}/").status_code == 200
    assert viewer.post(url, HTTP_IDEMPOTENCY_KEY="k1").status_code == 403
    assert not EmailDelivery.objects.exists()
    assert not Job.objects.exists()
    assert not OperatorAction.objects.exists()

    first = operator.post(url, HTTP_IDEMPOTENCY_KEY="k1")
    again = operator.post(url, HTTP_IDEMPOTENCY_KEY="k1")  # the same request, retried

    assert (first.status_code, again.status_code) == (202, 202)
    action = OperatorAction.objects.get()
    assert (action.action, action.actor, action.target) == ("invoice.email_resend", "api:op", paid)
    assert action.detail == f"requested under {first.json()['key']}"


def test_the_corrected_recipient_is_shown_beside_the_providers() -> None:
    paid = invoice("in_c")
    Invoice.objects.filter(pk=paid.pk).update(recipient_override="right@example.com")
    body = api_as(staff_user("op", groups=["viewers"])).get(f"/api/invoices/{paid.pk}/").json()
    assert (body["customer_email"], body["recipient_override"]) == (
        "x@example.com",
        "right@example.com",
    )
