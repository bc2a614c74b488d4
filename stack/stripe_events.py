"""Realistic Stripe events, snapshot and thin, signed exactly as Stripe signs them.

Shared by the tests, the benchmarks, the chaos suite, the demo and ``python -m
stack.stripe_trigger``. Signed with ``hmac`` directly, not stripe-python, so the receiver is
tested against an independent signer.
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


# The event types Stripe's CLI triggers (stripe/stripe-cli pkg/fixtures/triggers/*.json and
# their aliases; not its trigger names that are no event type, subscription.payment_*, nor its
# .eu and .gb variants), each after the object it carries: its ``object`` and its id's prefix
# ("-": it has no id). The v1.* types are thin events, which refer to their object.
_TRIGGERS = """
account acct account.updated
application ca account.application.deauthorized
balance - balance.available
billing.meter mtr v1.billing.meter.error_report_triggered v1.billing.meter.no_meter_found
billing_portal.configuration bpc billing_portal.configuration.created
billing_portal.configuration bpc billing_portal.configuration.updated
billing_portal.session bps billing_portal.session.created
card card customer.source.created customer.source.updated
cash_balance - cash_balance.funds_available
charge ch charge.captured charge.failed charge.refunded charge.succeeded
checkout.session cs checkout.session.async_payment_failed checkout.session.completed
checkout.session cs checkout.session.async_payment_succeeded checkout.session.expired
coupon coupon coupon.created coupon.deleted coupon.updated
credit_note cn credit_note.created credit_note.updated credit_note.voided
customer cus customer.created customer.deleted customer.updated
customer_cash_balance_transaction ccsbtxn customer_cash_balance_transaction.created
discount di customer.discount.created customer.discount.deleted customer.discount.updated
dispute dp charge.dispute.closed charge.dispute.created charge.dispute.updated
identity.verification_session vs identity.verification_session.canceled
identity.verification_session vs identity.verification_session.created
identity.verification_session vs identity.verification_session.redacted
invoice in invoice.created invoice.deleted invoice.finalized invoice.marked_uncollectible
invoice in invoice.paid invoice.payment_action_required invoice.payment_failed
invoice in invoice.payment_succeeded invoice.sent invoice.updated invoice.voided
invoiceitem ii invoiceitem.created invoiceitem.deleted
issuing.authorization iauth issuing_authorization.request
issuing.card ic issuing_card.created
issuing.cardholder ich issuing_cardholder.created
issuing.transaction ipi issuing_transaction.created issuing_transaction.updated
issuing.transaction ipi issuing_transaction.purchase_details_receipt_updated
payment_intent pi payment_intent.amount_capturable_updated payment_intent.canceled
payment_intent pi payment_intent.created payment_intent.partially_funded
payment_intent pi payment_intent.payment_failed payment_intent.processing
payment_intent pi payment_intent.requires_action payment_intent.succeeded
payment_link plink payment_link.created payment_link.updated
payment_method pm payment_method.attached payment_method.detached payment_method.updated
payout po payout.created payout.updated
plan plan plan.created plan.deleted plan.updated
price price price.created price.updated
product prod product.created product.deleted product.updated
promotion_code promo promotion_code.created promotion_code.updated
quote qt quote.accepted quote.canceled quote.created quote.finalized
refund re charge.refund.updated
reporting.report_run frr reporting.report_run.succeeded
setup_intent seti setup_intent.canceled setup_intent.created setup_intent.requires_action
setup_intent seti setup_intent.setup_failed setup_intent.succeeded
subscription sub customer.subscription.created customer.subscription.deleted
subscription sub customer.subscription.paused customer.subscription.trial_will_end
subscription sub customer.subscription.updated
subscription_schedule sub_sched subscription_schedule.aborted subscription_schedule.canceled
subscription_schedule sub_sched subscription_schedule.completed subscription_schedule.created
subscription_schedule sub_sched subscription_schedule.expiring subscription_schedule.released
subscription_schedule sub_sched subscription_schedule.updated
tax_rate txr tax_rate.created tax_rate.updated
test_helpers.test_clock clock test_helpers.test_clock.advancing test_helpers.test_clock.created
test_helpers.test_clock clock test_helpers.test_clock.deleted test_helpers.test_clock.ready
topup tu topup.created
transfer tr transfer.created transfer.reversed transfer.updated
"""
# Thin events that refer to no object: no meter was found (stripe-python's and stripe-ruby's
# notification classes for it, generated from Stripe's API spec, have no related_object).
_THIN_WITHOUT_OBJECT = {"v1.billing.meter.no_meter_found"}
# Event type -> (object, id prefix).
TRIGGER_OBJECTS = {
    event_type: (obj, prefix.strip("-"))
    for obj, prefix, *event_types in map(str.split, _TRIGGERS.strip().splitlines())
    for event_type in event_types
}
# The objects the fixtures create with an amount (2000 usd), and the invoice's status after
# each fixture's last call ("open" unless named).
_WITH_AMOUNT = {
    "charge",
    "dispute",
    "invoiceitem",
    "payment_intent",
    "payout",
    "refund",
    "topup",
    "transfer",
}
_INVOICE_STATUS = {
    "invoice.created": "draft",
    "invoice.deleted": "draft",
    "invoice.updated": "draft",
    "invoice.marked_uncollectible": "uncollectible",
    "invoice.paid": "paid",
    "invoice.payment_succeeded": "paid",
    "invoice.voided": "void",
}


def trigger_event(
    event_type: str,
    *,
    invoice_id: str | None = None,
    customer_email: str = DEFAULT_CUSTOMER_EMAIL,
    customer_name: str | None = DEFAULT_CUSTOMER_NAME,
    amount: int = 2000,
    currency: str = "usd",
) -> dict[str, Any]:
    """An event of a type of ``TRIGGER_OBJECTS`` with its object: an invoice or a customer
    with the fields given, any other with its id, ``object`` and amount if it has one."""
    kind, prefix = TRIGGER_OBJECTS[event_type]
    if event_type in _THIN_WITHOUT_OBJECT:
        return thin_event(event_type, None)
    if event_type.startswith("v1."):
        object_id = new_id(prefix)
        url = f"/v1/{kind.replace('.', '/')}s/{object_id}"
        return thin_event(event_type, {"id": object_id, "type": kind, "url": url})
    if kind == "invoice":
        obj = invoice_object(
            invoice_id=invoice_id or new_id("in"),
            customer_email=customer_email,
            customer_name=customer_name,
            amount=amount,
            currency=currency,
            status=_INVOICE_STATUS.get(event_type, "open"),
        )
    elif kind == "customer":
        obj = customer_object(customer_email=customer_email, customer_name=customer_name)
    else:
        obj = {"id": new_id(prefix)} if prefix else {}
        obj |= {"object": kind, "created": int(time.time()), "livemode": False, "metadata": {}}
        if kind in _WITH_AMOUNT:
            obj |= {"amount": amount, "currency": currency}
    return event(event_type, obj)
