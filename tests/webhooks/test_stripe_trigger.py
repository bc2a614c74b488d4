"""``manage.py stripe_trigger`` against a live server: signed as Stripe signs, duplicates and
stale timestamps behave as real deliveries do."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from invoicing.models import Invoice
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)


def trigger(live_server: Any, *args: str) -> str:
    out = StringIO()
    call_command(
        "stripe_trigger", *args, "--url", f"{live_server.url}/webhooks/stripe/", stdout=out
    )
    return out.getvalue()


def test_repeat_delivers_one_event_three_times(live_server: Any) -> None:
    out = trigger(
        live_server,
        "invoice.paid",
        "--repeat",
        "3",
        "--invoice-id",
        "in_trigger1",
        "--customer-email",
        "t@example.com",
    )
    assert out.count(": 200 ") == 3
    assert out.count('"duplicate": true') == 2
    event = WebhookEvent.objects.get()
    assert event.type == "invoice.paid"
    assert ",v0=" in event.headers["Stripe-Signature"]  # the fake v0 test mode sends
    assert event.headers["User-Agent"].startswith("Stripe/1.0")
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.customer_email) == ("in_trigger1", "t@example.com")


@pytest.mark.parametrize(
    ("args", "email", "name"),
    [
        ((), "jenny.rosen@example.com", "Jenny Rosen"),
        (("--customer-email", "t@example.com"), "t@example.com", ""),
        (
            ("--customer-email", "t@example.com", "--customer-name", "Ada Lovelace"),
            "t@example.com",
            "Ada Lovelace",
        ),
        (("--customer-name", "Ada Lovelace"), "jenny.rosen@example.com", "Ada Lovelace"),
    ],
    ids=["defaults", "email-only", "email-and-name", "name-only"],
)
def test_the_recipient_is_the_one_given_with_no_one_elses_name(
    live_server: Any, args: tuple[str, ...], email: str, name: str
) -> None:
    trigger(live_server, "invoice.paid", *args)
    invoice = Invoice.objects.get()
    assert (invoice.customer_email, invoice.customer_name) == (email, name)
    sent = json.loads(WebhookEvent.objects.get().body)["data"]["object"]
    assert sent["customer_name"] == (name or None)  # as Stripe sends a customer with no name


def test_several_event_types_for_one_invoice(live_server: Any) -> None:
    for event_type in (
        "invoice.payment_failed",
        "invoice.paid",
        "invoice.payment_succeeded",
        "customer.created",
    ):
        trigger(live_server, event_type, "--invoice-id", "in_trigger2")
    assert WebhookEvent.objects.count() == 4
    assert Invoice.objects.get().status == "paid"


def test_stale_is_refused_with_a_clear_error(live_server: Any) -> None:
    with pytest.raises(CommandError, match="1 of 1 deliveries were not accepted"):
        trigger(live_server, "invoice.paid", "--stale")
    assert not WebhookEvent.objects.exists()


def test_bad_arguments_are_clear_errors(live_server: Any) -> None:
    with pytest.raises(CommandError, match="--repeat must be at least 1"):
        trigger(live_server, "invoice.paid", "--repeat", "0")
    with pytest.raises(CommandError, match="in_"):
        trigger(live_server, "invoice.paid", "--invoice-id", "bogus")
