"""Realistic Stripe events, snapshot and thin, signed exactly as Stripe signs them.

Shared by the tests, the benchmarks, the demo and ``manage.py stripe_trigger``. Signed with
``hmac`` directly, not stripe-python, so the receiver is tested against an independent signer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from datetime import UTC, datetime
from typing import Any

API_VERSION = "2025-09-30.clover"  # STRIPE_API_VERSION's default: the handlers' version
DEFAULT_CUSTOMER_EMAIL = "jenny.rosen@example.com"
DEFAULT_CUSTOMER_NAME = "Jenny Rosen"


def signature_header(
    payload: bytes, secret: str, *, timestamp: int | None = None, with_v0: bool = False
) -> str:
    """``t=<ts>,v1=<hex hmac-sha256 of "<ts>.<body>">`` (and a fake ``v0``, as test mode sends)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    header = f"t={timestamp},v1={mac.hexdigest()}"
    if with_v0:
        header += f",v0={secrets.token_hex(32)}"
    return header


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def invoice_object(
    *,
    invoice_id: str,
    customer_email: str = DEFAULT_CUSTOMER_EMAIL,
    customer_name: str | None = DEFAULT_CUSTOMER_NAME,  # None: Stripe's null, no name
    amount: int = 2000,
    currency: str = "usd",
    status: str = "paid",
    number: str | None = None,
    paid_at: int | None = None,
) -> dict[str, Any]:
    now = int(time.time())
    paid = status == "paid"
    return {
        "id": invoice_id,
        "object": "invoice",
        "account_country": "US",
        "account_name": "Example, Inc.",
        "amount_due": amount,
        "amount_paid": amount if paid else 0,
        "amount_remaining": 0 if paid else amount,
        "attempt_count": 1,
        "attempted": True,
        "billing_reason": "subscription_cycle",
        "collection_method": "charge_automatically",
        "created": now - 3600,
        "currency": currency,
        "customer": "cus_" + invoice_id[-14:],
        "customer_email": customer_email,
        "customer_name": customer_name,
        "hosted_invoice_url": f"https://invoice.stripe.com/i/acct_test/{invoice_id}",
        "invoice_pdf": f"https://pay.stripe.com/invoice/acct_test/{invoice_id}/pdf",
        "lines": {"object": "list", "data": [], "has_more": False, "total_count": 0},
        "livemode": False,
        "number": number or f"INV-{invoice_id[-8:].upper()}",
        "paid": paid,
        "period_end": now,
        "period_start": now - 30 * 86400,
        "status": status,
        "status_transitions": {
            "finalized_at": now - 3600,
            "paid_at": (paid_at or now) if paid else None,
            "voided_at": None,
            "marked_uncollectible_at": None,
        },
        "subtotal": amount,
        "total": amount,
    }


def customer_object(
    *,
    customer_email: str = DEFAULT_CUSTOMER_EMAIL,
    customer_name: str | None = DEFAULT_CUSTOMER_NAME,
) -> dict[str, Any]:
    return {
        "id": new_id("cus"),
        "object": "customer",
        "created": int(time.time()),
        "email": customer_email,
        "livemode": False,
        "name": customer_name,
    }


def event(
    event_type: str, obj: dict[str, Any], *, event_id: str | None = None, created: int | None = None
) -> dict[str, Any]:
    return {
        "id": event_id or new_id("evt"),
        "object": "event",
        "api_version": API_VERSION,
        "created": int(time.time()) if created is None else created,
        "data": {"object": obj},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": new_id("req"), "idempotency_key": None},
        "type": event_type,
    }


def encode(body: dict[str, Any]) -> bytes:
    # Stripe sends pretty-printed JSON; the receiver must verify the bytes exactly as sent.
    return json.dumps(body, indent=2).encode()


def thin_event(
    event_type: str, related_object: dict[str, str] | None, *, created: str | None = None
) -> dict[str, Any]:
    """A thin event as an event destination sends it: ``created`` an ISO 8601 string, no
    ``api_version`` and no ``data``, the object concerned by reference (``related_object``)."""
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {
        "id": new_id("evt"),
        "object": "v2.core.event",
        "type": event_type,
        "created": now if created is None else created,
        "livemode": False,
        "context": None,
        "reason": {
            "type": "request",
            "request": {"id": new_id("req"), "idempotency_key": str(uuid.uuid4())},
        },
        "related_object": related_object,
    }
