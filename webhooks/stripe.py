"""Verifying and reading Stripe webhook deliveries.

Signature checking is stripe-python's ``WebhookSignature.verify_header`` (HMAC-SHA256 over
``"{t}.{body}"``, constant-time comparison, any ``v1`` may match), called once per configured
secret so a secret can be rolled. Around it we cover what it does not (PITFALLS.md):

* a timestamp too far in the *future* (stripe-python rejects only stale ones);
* a body that is not UTF-8 (stripe-python raises ``UnicodeDecodeError``, which would be a 500);
* a header that is not ASCII (``hmac.compare_digest`` raises ``TypeError`` on such a string);
* a zero tolerance (stripe-python then skips the check; settings refuse it).

A signed event is authentic, not harmless (a leaked secret, a test-mode secret configured
beside the live one, a customer typing a name). So ``event_parse``:

* refuses (400) an event whose id, type or invoice id is not printable text: no lone
  surrogates, controls or surrounding spaces; we could not key on it;
* makes every free-text field we keep (name, number, address, URL) storable rather than
  refusing it: a lone surrogate (``\\ud800`` is valid JSON) becomes U+FFFD and NUL is dropped,
  so a customer's typo never costs the payment its record or its receipt. Whether the text is
  fit for a header or a link is decided where it is used (``invoicing.mail``);
* marks an event of the other Stripe mode (``STRIPE_LIVEMODE``), or for another Connect
  account (``STRIPE_ACCOUNT``), as out of scope before reading its object: it is stored as
  ignored with the reason, and changes nothing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeGuard

import stripe
from django.conf import settings

from core.db import text_storable
from invoicing.services import InvoiceData


class WebhookRejected(Exception):
    """A delivery we refuse, with a short reason for the 4xx body."""

    def __init__(self, reason: str, *, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


_TIMESTAMP = re.compile(r"[0-9]{1,12}")


def signature_verify(
    *,
    payload: bytes,
    header: str | None,
    secrets: Sequence[str],
    tolerance: int,
    now: float | None = None,
) -> int:
    """Verify a ``Stripe-Signature`` header; return its timestamp or raise ``WebhookRejected``."""
    if not header or not header.strip():
        raise WebhookRejected("missing Stripe-Signature header")
    if not header.isascii():
        raise WebhookRejected("malformed Stripe-Signature header")
    pairs = [item.partition("=") for item in header.split(",")]
    timestamps = [value for key, sep, value in pairs if key.strip() == "t" and sep]
    if len(timestamps) != 1 or not _TIMESTAMP.fullmatch(timestamps[0]):
        raise WebhookRejected("malformed Stripe-Signature header")
    if not any(key == "v1" and value for key, _, value in pairs):
        raise WebhookRejected("no v1 signature in Stripe-Signature header")
    timestamp = int(timestamps[0])
    now = time.time() if now is None else now
    if timestamp < now - tolerance:
        raise WebhookRejected("signature timestamp too old")
    if timestamp > now + tolerance:
        raise WebhookRejected("signature timestamp in the future")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WebhookRejected("body is not UTF-8") from exc
    for secret in secrets:
        try:
            # The tolerance was checked above, in both directions, on one clock.
            stripe.WebhookSignature.verify_header(text, header, secret, tolerance=None)
        except stripe.SignatureVerificationError:
            continue
        return timestamp
    raise WebhookRejected("no signature matches")


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    created: datetime
    livemode: bool
    invoice: InvoiceData | None  # set for the invoice events we act on
    # Why this endpoint does not act on it (another mode or account), or "" if it may.
    out_of_scope: str = ""


PAYMENT_EVENT_TYPES = frozenset({"invoice.paid", "invoice.payment_succeeded"})


def _text(obj: dict[str, Any], key: str, *, limit: int = 1000) -> str:
    """A free-text field we keep, made storable (lone surrogates replaced, NUL dropped)."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebhookRejected(f"data.object.{key} is not a string")
    if len(value) > limit:
        raise WebhookRejected(f"data.object.{key} is too long")
    return text_storable(value)


def _int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise WebhookRejected(f"{key} is not a non-negative integer")
    return value


_MAX_EPOCH = 253402300799  # 9999-12-31T23:59:59Z


def _epoch(obj: dict[str, Any], key: str) -> datetime | None:
    value = _int(obj, key)
    if value is None:
        return None
    if value > _MAX_EPOCH:
        raise WebhookRejected(f"{key} is not a plausible timestamp")
    return datetime.fromtimestamp(value, tz=UTC)


def _invoice(obj: Any, event_type: str) -> InvoiceData:
    if not isinstance(obj, dict):
        raise WebhookRejected("data.object is missing")
    invoice_id = obj.get("id")
    if invoice_id is None or invoice_id == "":
        raise WebhookRejected("data.object.id is missing")
    if not _is_name(invoice_id):
        raise WebhookRejected("data.object.id is malformed")
    currency = _text(obj, "currency", limit=3).lower()
    if currency and not re.fullmatch(r"[a-z]{3}", currency):
        raise WebhookRejected("data.object.currency is not a 3-letter code")
    transitions = obj.get("status_transitions")
    paid_at = _epoch(transitions, "paid_at") if isinstance(transitions, dict) else None
    status = _text(obj, "status", limit=20) or "paid"
    if status not in {"draft", "open", "paid", "uncollectible", "void"}:
        raise WebhookRejected("data.object.status is not an invoice status")
    return InvoiceData(
        provider_invoice_id=invoice_id,
        number=_text(obj, "number", limit=255),
        customer_email=_text(obj, "customer_email", limit=320),
        customer_name=_text(obj, "customer_name", limit=255),
        amount_paid=_int(obj, "amount_paid") or 0,
        currency=currency,
        status=status,
        hosted_invoice_url=_text(obj, "hosted_invoice_url", limit=2000),
        paid_at=paid_at,
    )


def _is_name(value: Any) -> TypeGuard[str]:
    """An identifier we key on: 1-255 printable characters (no controls, no lone surrogates,
    which ``isprintable`` counts as unprintable), no surrounding spaces."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 255
        and value.strip() == value
        and value.isprintable()
    )


def event_scope_check(*, livemode: bool, account: Any) -> str:
    """Why this endpoint does not act on an event of this mode and account (settings
    ``STRIPE_LIVEMODE`` and ``STRIPE_ACCOUNT``, read now), or "" if it does."""
    mode = settings.STRIPE_LIVEMODE
    if mode != "any" and livemode != (mode == "live"):
        return f"{'live' if livemode else 'test'}-mode event; STRIPE_LIVEMODE is {mode}"
    wanted = settings.STRIPE_ACCOUNT
    if wanted and account != wanted:
        # The account is the sender's text: repr() keeps it printable and storable.
        whose = "the platform" if account is None else f"account {str(account)[:64]!r}"
        return f"event for {whose}; STRIPE_ACCOUNT is {wanted}"
    return ""


def event_parse(*, payload: bytes, signed_at: int) -> Event:
    """Read a verified body as a Stripe event; unknown fields are ignored."""
    if b"\x00" in payload:
        raise WebhookRejected("body contains a NUL byte")
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise WebhookRejected("body is not JSON") from exc
    if not isinstance(data, dict):
        raise WebhookRejected("body is not a JSON object")
    event_id, event_type = data.get("id"), data.get("type")
    if not _is_name(event_id):
        raise WebhookRejected(
            "event has no id" if event_id in (None, "") else "event id is malformed"
        )
    if not _is_name(event_type):
        raise WebhookRejected(
            "event has no type" if event_type in (None, "") else "event type is malformed"
        )
    created = _epoch(data, "created") or datetime.fromtimestamp(signed_at, tz=UTC)
    # Only an explicit true is live: with STRIPE_LIVEMODE=live, anything else is ignored.
    livemode = data.get("livemode") is True
    # Decided before the object is read: an event that is not ours is ignored whatever it holds.
    out_of_scope = event_scope_check(livemode=livemode, account=data.get("account"))
    invoice = None
    if event_type in PAYMENT_EVENT_TYPES and not out_of_scope:
        inner = data.get("data")
        invoice = _invoice(inner.get("object") if isinstance(inner, dict) else None, event_type)
    return Event(
        id=event_id,
        type=event_type,
        created=created,
        livemode=livemode,
        invoice=invoice,
        out_of_scope=out_of_scope,
    )
