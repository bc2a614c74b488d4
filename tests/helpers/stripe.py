"""Stripe's side of a delivery: events, signed as Stripe signs them with the tests' secret
(``tests/settings.py``), posted through Django's test client or over real HTTP."""

from __future__ import annotations

import time
from typing import Any

import requests
from django.test import Client

from stack import stripe_events
from stack.stripe_api import ERROR, HANG, MALFORMED, RATE_LIMITED

SECRET = "whsec_test_primary"
WEBHOOK_URL = "/webhooks/stripe/"

# Each fault of the Stripe API's stand-in, and the words the application's failure gives it
# (``webhooks.stripe_api.stripe_error_sorted``): all four may pass.
API_FAULT_WORDS = [
    (ERROR, "HTTP 500, Sorry, something went wrong."),
    (RATE_LIMITED, "HTTP 429, Too many requests hit the API too quickly."),
    (HANG, "ReadTimeout"),
    (MALFORMED, "HTTP 200, not Stripe's JSON"),
]


def post_event(
    client: Client,
    body: bytes,
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
    header: str | None = None,
    **extra: Any,
) -> Any:
    """POST ``body`` to the webhook with Django's test client, signed with ``secret`` at
    ``timestamp`` (now), or with ``header`` as it is."""
    if header is None:
        header = stripe_events.signature_header(body, secret, timestamp=timestamp)
    return client.post(
        WEBHOOK_URL,
        data=body,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=header,
        **extra,
    )


def post_signed(url: str, body: bytes) -> requests.Response:
    """POST ``body`` signed like Stripe over real HTTP (a live server, gunicorn, the edge)."""
    return requests.post(
        url,
        data=body,
        headers={
            "Content-Type": "application/json",
            "Stripe-Signature": stripe_events.signature_header(body, SECRET),
        },
        timeout=10,
    )


def paid_event(
    invoice_id: str | None = None,
    *,
    event_type: str = "invoice.paid",
    created: int | None = None,
    **invoice: Any,
) -> dict[str, Any]:
    """An ``invoice.paid`` event (or ``event_type``) for a new invoice unless given."""
    invoice_id = invoice_id or stripe_events.new_id("in")
    return stripe_events.event(
        event_type,
        stripe_events.invoice_object(invoice_id=invoice_id, **invoice),
        created=created,
    )


def cli_invoice_paid_events(*, customer_email: str | None = None) -> list[dict[str, Any]]:
    """The events ``stripe trigger invoice.paid`` produces, in the order its fixture makes
    them (stripe/stripe-cli pkg/fixtures/triggers/invoice.paid.json): a customer with a
    description and no email (``customer_email`` is what ``--override customer:email=...``
    gives it), a card attached, an invoice item of 2000 usd, an invoice created, finalized
    and paid with the card. The invoice carries the customer's id, and its email as it was
    at finalization (null without one)."""
    now = int(time.time()) - 60
    ids = {p: stripe_events.new_id(p) for p in ("cus", "pm", "ii", "in", "pi", "ch")}
    cli = "(created by Stripe CLI)"
    number = f"{ids['cus'][4:12].upper()}-0001"
    common = {"livemode": False, "metadata": {}}
    customer = {
        "id": ids["cus"],
        "object": "customer",
        "balance": 0,
        "created": now,
        "description": cli,
        "email": customer_email,
        "invoice_prefix": number[:8],
        "name": None,
        "phone": None,
        **common,
    }
    card = {
        "id": ids["pm"],
        "object": "payment_method",
        "billing_details": {"address": None, "email": None, "name": None, "phone": None},
        "card": {"brand": "visa", "country": "US", "funding": "credit", "last4": "4242"},
        "created": now + 1,
        "customer": ids["cus"],
        "type": "card",
        **common,
    }
    item = {
        "id": ids["ii"],
        "object": "invoiceitem",
        "amount": 2000,
        "currency": "usd",
        "customer": ids["cus"],
        "date": now + 2,
        "description": cli,
        "invoice": None,
        **common,
    }

    def invoice(status: str) -> dict[str, Any]:
        obj = stripe_events.invoice_object(
            invoice_id=ids["in"], customer_name=None, status=status, paid_at=now + 5
        )
        finalized = status != "draft"
        return {
            **obj,
            "billing_reason": "manual",
            "created": now + 3,
            "customer": ids["cus"],
            "customer_email": customer_email,
            "description": cli,
            "hosted_invoice_url": obj["hosted_invoice_url"] if finalized else None,
            "invoice_pdf": obj["invoice_pdf"] if finalized else None,
            "number": number if finalized else None,
            "status_transitions": {
                **obj["status_transitions"],
                "finalized_at": now + 4 if finalized else None,
            },
        }

    def intent(status: str) -> dict[str, Any]:
        succeeded = status == "succeeded"
        return {
            "id": ids["pi"],
            "object": "payment_intent",
            "amount": 2000,
            "amount_received": 2000 if succeeded else 0,
            "currency": "usd",
            "customer": ids["cus"],
            "description": f"Payment for Invoice {number}",
            "latest_charge": ids["ch"] if succeeded else None,
            "payment_method": ids["pm"] if succeeded else None,
            "status": status,
            **common,
        }

    charge = {
        "id": ids["ch"],
        "object": "charge",
        "amount": 2000,
        "billing_details": card["billing_details"],
        "captured": True,
        "currency": "usd",
        "customer": ids["cus"],
        "paid": True,
        "payment_intent": ids["pi"],
        "payment_method": ids["pm"],
        "receipt_email": None,
        "status": "succeeded",
        **common,
    }
    made = [
        ("customer.created", customer),
        ("payment_method.attached", card),
        ("invoiceitem.created", item),
        ("invoice.created", invoice("draft")),
        ("invoice.finalized", invoice("open")),
        ("invoice.paid", invoice("paid")),
        ("invoice.payment_succeeded", invoice("paid")),
        ("payment_intent.created", intent("requires_payment_method")),
        ("payment_intent.succeeded", intent("succeeded")),
        ("charge.succeeded", charge),
    ]
    return [
        stripe_events.event(event_type, obj, created=now + n)
        for n, (event_type, obj) in enumerate(made)
    ]
