"""POST /api/invoices/{id}/recipient/: the admin's correction of where an invoice's emails go,
over real API tokens. It needs the view permission and ``correct_invoice_recipient`` (403
without, nothing changed); a bad address or reason is 400 with the service's words, nothing
changed; a correction is recorded as ``api:<username>`` with its reason, before and after; the
same correction again, even at once, changes nothing more and answers ``changed: false``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from knox.models import AuthToken
from rest_framework.test import APIClient

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.models import DeadLetter
from invoicing.models import Invoice
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.database import lock_waiters
from tests.helpers.deadletters import refused_invoice_dead_letter
from tests.helpers.factories import paid_invoice, staff_user
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet

pytestmark = pytest.mark.django_db(transaction=True)


def api_as(user: Any) -> APIClient:
    """A client sending a real API token of ``user`` (``Authorization: Token``)."""
    _, token = AuthToken.objects.create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.fixture
def operator() -> APIClient:
    return api_as(staff_user("op", groups=["operators"]))


def correct(client: APIClient, invoice_id: int, **body: Any) -> Any:
    return client.post(f"/api/invoices/{invoice_id}/recipient/", body, format="json")


def unchanged(invoice: Invoice) -> None:
    """``invoice`` is as it was made, and no operator action was recorded."""
    stored = Invoice.objects.get(pk=invoice.pk)
    assert (stored.customer_email, stored.recipient_override, stored.updated_at) == (
        invoice.customer_email,
        invoice.recipient_override,
        invoice.updated_at,
    )
    assert not OperatorAction.objects.exists()


def test_without_the_power_it_is_refused_and_nothing_changes() -> None:
    paid = paid_invoice()
    body = {"email": "right@example.com", "reason": "typo"}
    viewer = api_as(staff_user("watcher", groups=["viewers"]))
    assert viewer.get(f"/api/invoices/{paid.pk}/").status_code == 200  # reading is allowed
    assert correct(viewer, paid.pk, **body).status_code == 403
    # The power without the view permission, as in the admin, is not enough either.
    blind = api_as(staff_user("blind", perms=["invoicing.correct_invoice_recipient"]))
    assert correct(blind, paid.pk, **body).status_code == 403
    # Nor is every permission without is_staff.
    outsider = api_as(staff_user("outsider", groups=["operators"], is_staff=False))
    assert correct(outsider, paid.pk, **body).status_code == 403
    anonymous = APIClient().post(f"/api/invoices/{paid.pk}/recipient/", body, format="json")
    assert anonymous.status_code == 401
    unchanged(paid)


@pytest.mark.parametrize(
    ("body", "answer"),
    [
        (
            {"email": "not an address", "reason": "typo"},
            {
                "detail": "'not an address' is not a valid email address: invalid recipient "
                "address 'not an address': An email address must have an @-sign."
            },
        ),
        (
            {"email": "a@example.com\r\nBcc: b@example.com", "reason": "typo"},
            {
                "detail": "'a@example.com\\r\\nBcc: b@example.com' is not a valid email address: "
                "header injection in customer email: a line break or control character in it"
            },
        ),
        (
            {"email": "right@example.com", "reason": " \n "},
            {"reason": ["This field may not be blank."]},
        ),
        ({"email": "right@example.com"}, {"reason": ["This field is required."]}),
        ({"reason": "typo"}, {"email": ["This field is required."]}),
        (
            {"email": "right@example.com", "reason": "x" * 501},
            {"reason": ["Ensure this field has no more than 500 characters."]},
        ),
        ({"email": ["right@example.com"], "reason": "typo"}, {"email": ["Not a valid string."]}),
    ],
)
def test_bad_input_is_400_with_a_reason_and_changes_nothing(
    operator: APIClient, body: dict[str, Any], answer: dict[str, Any]
) -> None:
    paid = paid_invoice()
    refused = correct(operator, paid.pk, **body)
    assert (refused.status_code, refused.json()) == (400, answer)
    unchanged(paid)


def test_a_body_that_is_not_an_object_is_400(operator: APIClient) -> None:
    paid = paid_invoice()
    url = f"/api/invoices/{paid.pk}/recipient/"
    assert operator.post(url, ["right@example.com"], format="json").status_code == 400
    broken = operator.post(url, "{not json", content_type="application/json")
    assert broken.status_code == 400
    assert "JSON parse error" in broken.json()["detail"]
    unchanged(paid)


def test_no_invoice_is_404_and_reading_the_route_is_405(operator: APIClient) -> None:
    assert correct(operator, 424242, email="a@example.com", reason="x").status_code == 404
    paid = paid_invoice()
    assert operator.get(f"/api/invoices/{paid.pk}/recipient/").status_code == 405
    unchanged(paid)


def test_a_correction_is_recorded_and_a_repeat_changes_nothing(operator: APIClient) -> None:
    paid = paid_invoice("in_api_1", customer_email="typo@exmaple.com")

    done = correct(operator, paid.pk, email=" right@example.com ", reason="customer called, #7")
    assert done.status_code == 200
    assert done.json() == {
        "id": paid.pk,
        "customer_email": "typo@exmaple.com",
        "recipient_override": "right@example.com",
        "recipient": "right@example.com",
        "changed": True,
        "detail": "emails now go to right@example.com; nothing was sent: replay its dead "
        "letter or resend its email",
    }
    paid.refresh_from_db()
    assert (paid.customer_email, paid.recipient_override, paid.recipient) == (
        "typo@exmaple.com",
        "right@example.com",
        "right@example.com",
    )
    recorded = OperatorAction.objects.get()
    assert (recorded.action, recorded.actor, recorded.target, recorded.detail) == (
        "invoice.recipient_correct",
        "api:op",
        paid,
        "customer called, #7",
    )
    assert recorded.before == {"recipient_override": "", "recipient": "typo@exmaple.com"}
    assert recorded.after == {
        "recipient_override": "right@example.com",
        "recipient": "right@example.com",
    }
    listed = operator.get(f"/api/invoices/{paid.pk}/").json()
    assert (listed["customer_email"], listed["recipient_override"]) == (
        "typo@exmaple.com",
        "right@example.com",
    )

    # A client's retry: answered as done, nothing more recorded.
    again = correct(operator, paid.pk, email="right@example.com", reason="customer called, #7")
    assert again.status_code == 200
    assert (again.json()["changed"], again.json()["detail"]) == (
        False,
        "the recipient is already right@example.com",
    )
    assert again.json()["recipient"] == "right@example.com"
    assert OperatorAction.objects.count() == 1

    # Empty: the correction removed, the provider's address again.
    removed = correct(operator, paid.pk, email="", reason="the customer fixed it at Stripe")
    assert removed.status_code == 200
    assert {k: removed.json()[k] for k in ("recipient_override", "recipient", "changed")} == {
        "recipient_override": "",
        "recipient": "typo@exmaple.com",
        "changed": True,
    }
    assert removed.json()["detail"].startswith(
        "emails now go to typo@exmaple.com (the provider's address)"
    )
    latest = OperatorAction.objects.latest("pk")
    assert (latest.before, latest.after) == (recorded.after, recorded.before)
    removed_again = correct(operator, paid.pk, email="", reason="the customer fixed it at Stripe")
    assert (removed_again.status_code, removed_again.json()["changed"]) == (200, False)
    assert removed_again.json()["detail"] == "there is no correction to remove"
    assert OperatorAction.objects.count() == 2


def test_the_same_correction_twice_at_once_is_made_once() -> None:
    """Two requests for one correction, held on the invoice's row lock until both wait for it:
    one corrects, the other finds it done; one record."""
    paid = paid_invoice()
    user = staff_user("op", groups=["operators"])
    answers: list[tuple[int, bool]] = []
    errors: list[BaseException] = []

    def request(client: APIClient) -> None:
        try:
            answer = correct(client, paid.pk, email="right@example.com", reason="typo")
            answers.append((answer.status_code, answer.json()["changed"]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    holder = connections.create_connection("default")
    threads = [threading.Thread(target=request, args=(api_as(user),)) for _ in range(2)]
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1 FROM invoicing_invoice WHERE id = %s FOR UPDATE", [paid.pk])
            for thread in threads:
                thread.start()
            assert wait_until(lambda: lock_waiters() == 2, timeout=20)
            time.sleep(0.2)
            cursor.execute("COMMIT")
        for thread in threads:
            thread.join(30)
    finally:
        holder.close()

    assert errors == []
    assert sorted(answers) == [(200, False), (200, True)]
    assert Invoice.objects.get(pk=paid.pk).recipient_override == "right@example.com"
    assert OperatorAction.objects.count() == 1


def test_a_refused_address_fixed_and_replayed_over_the_api_alone(
    client: Client, operator: APIClient, smtp: SmtpServer
) -> None:
    """The operator's path without a browser: the dead letter's invoice, its recipient
    corrected, the dead letter replayed; the email goes to the corrected address."""
    with worker_thread():
        paid, letter = refused_invoice_dead_letter(client, smtp)
        [waiting] = operator.get("/api/dead-letters/?replayed=false").json()["results"]
        assert (waiting["id"], waiting["subject"]["recipient"]) == (letter.pk, "typo@exmaple.com")
        fixed = correct(operator, paid.pk, email="fixed@example.com", reason="typo, ticket 7")
        assert (fixed.status_code, fixed.json()["recipient"]) == (200, "fixed@example.com")
        replayed = operator.post(f"/api/dead-letters/{letter.pk}/replay/")
        assert replayed.json()["replayed"] is True
        smtp.handler.wait_for(1, timeout=20)
        pipeline_quiet()

    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <fixed@example.com>"]
    assert DeadLetter.objects.get().replayed_by == "api:op"
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.action, a.actor) for a in recorded] == [
        ("invoice.recipient_correct", "api:op"),
        ("dead_letter.replay", "api:op"),
    ]
