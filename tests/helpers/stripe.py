"""Stripe's side of a delivery: events, signed as Stripe signs them with the tests' secret
(``tests/settings.py``), posted through Django's test client or over real HTTP."""

from __future__ import annotations

from typing import Any

import requests
from django.test import Client

from webhooks import testing as stripe_testing

SECRET = "whsec_test_primary"
WEBHOOK_URL = "/webhooks/stripe/"


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
        header = stripe_testing.signature_header(body, secret, timestamp=timestamp)
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
            "Stripe-Signature": stripe_testing.signature_header(body, SECRET),
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
    invoice_id = invoice_id or stripe_testing.new_id("in")
    return stripe_testing.event(
        event_type,
        stripe_testing.invoice_object(invoice_id=invoice_id, **invoice),
        created=created,
    )
