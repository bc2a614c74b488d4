"""``manage.py stripe_trigger`` against a live server: every event type Stripe's CLI triggers,
signed as Stripe signs, taken (applied when handled, stored ignored otherwise); duplicates and
stale timestamps behave as real deliveries do; an unknown type is one line and exit status 1."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from invoicing.models import Invoice
from stack.process import ROOT
from tests.helpers.processes import worker_env
from webhooks import stripe as webhook_events
from webhooks import testing as stripe_testing
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


def test_every_type_the_cli_triggers_is_taken(live_server: Any) -> None:
    known = sorted(stripe_testing.TRIGGER_OBJECTS)
    assert len(known) == 115
    assert {"invoice.voided", "charge.succeeded", "v1.billing.meter.no_meter_found"} < set(known)
    for event_type in known:
        out = trigger(live_server, event_type, "--invoice-id", "in_every", "--amount", "4200")
        assert out.startswith("delivery 1: 200 "), (event_type, out)

    stored = dict(WebhookEvent.objects.values_list("type", "state"))
    handled = {t for t in known if webhook_events.handler_for(t) is not None}
    assert handled == {"invoice.paid", "invoice.payment_succeeded"}
    assert stored == {t: "processed" if t in handled else "ignored" for t in known}
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.amount_paid, invoice.status) == (
        "in_every",
        4200,
        "paid",
    )


def test_each_event_carries_the_object_its_type_names() -> None:
    voided = stripe_testing.trigger_event("invoice.voided", invoice_id="in_void")["data"]["object"]
    assert (voided["object"], voided["id"], voided["status"]) == ("invoice", "in_void", "void")
    dispute = stripe_testing.trigger_event("charge.dispute.created")["data"]["object"]
    assert (dispute["object"], dispute["id"][:3], dispute["amount"]) == ("dispute", "dp_", 2000)
    balance = stripe_testing.trigger_event("balance.available")["data"]["object"]
    assert balance["object"] == "balance"
    assert "id" not in balance


def test_an_unknown_type_is_one_line_listing_the_known_ones(live_server: Any) -> None:
    with pytest.raises(CommandError, match=r"unknown event type 'invoice\.bogus'; known: "):
        trigger(live_server, "invoice.bogus")
    assert not WebhookEvent.objects.exists()
    result = subprocess.run(
        [sys.executable, "manage.py", "stripe_trigger", "invoice.bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=worker_env(0),
    )
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    known = line.split("; known: ")[1].split(", ")
    assert known == sorted(stripe_testing.TRIGGER_OBJECTS)
