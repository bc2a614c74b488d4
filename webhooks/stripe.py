"""Verifying and reading Stripe webhook deliveries, and which app acts on each event type.

An app declares ``@webhook_handler("invoice.paid", parse=...)`` on the function that applies those
events (``invoicing/services.py``). A type with a handler is stored as ``processed`` and is
essential under backpressure; any other is stored as ``ignored`` and shed first. Snapshot events and
thin events (``v2.core.event``) are declared alike.

Signatures are checked by stripe-python's ``WebhookSignature.verify_header``, once per configured
secret (so a secret can be rolled). Around it we refuse what it lets through or turns into a 500: a
timestamp in the future, a body that is not UTF-8, a header that is not ASCII. stripe-python's own
verify-and-parse calls (``StripeClient.construct_event``, ``parse_event_notification``) verify
against one secret, let a future timestamp pass, and raise ``UnicodeDecodeError`` on a body that is
not UTF-8: they are not used to verify.

A signed event is authentic, not harmless: ``event_parse`` refuses (400) an id or type we could not
key on, and marks an event of another mode or Connect account out of scope before reading its object
(stored as ignored, changing nothing). It reads snapshot events (``object`` "event", the object in
``data``) and thin events (``object`` "v2.core.event": ``created`` an ISO 8601 string, the Connect
account in ``context``, a ``related_object`` reference and no ``data``).

What every event is stored under (id, type, time, mode, account) is read here, not by stripe-python,
because it decides a 200 before any handler is known, and stripe-python's readers check none of it:
an ``EventNotification`` takes an id of any JSON type, keeps ``created`` as the text it was sent,
reads ``livemode`` "false" as live, and raises ``KeyError``, ``TypeError`` or ``AttributeError`` for
a missing ``created``, a null ``related_object`` of a type it knows, a ``context`` that is not text
or a ``reason`` without its ``request``: for a type nothing here handles, that would be a 400 (or a
500) where the contract is a 200 and a stored row. What a handler reads is stripe-python's: a thin
event's handler gets its ``EventNotification`` (``event_notification``); a snapshot event's gets
``data.object`` as decoded JSON, which its ``parse`` checks field by field, rather than
``construct_event``'s ``StripeObject``, which checks nothing and is no dict.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeGuard, TypeVar

import stripe
from django.conf import settings
from stripe.v2.core import EventNotification

from asyncwork.db import text_storable


class WebhookRejected(Exception):
    """A delivery we refuse, with a short reason for the 4xx body."""

    def __init__(self, reason: str, *, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    created: datetime
    livemode: bool
    # The Stripe API version its object is rendered in; "" if it has none (a thin event).
    api_version: str = ""
    # Set when this endpoint acts on the event: what its handler's parse made of data.object.
    handled: bool = False
    data: Any = None
    # Why this endpoint does not act on it (another mode or account), or "" if it may.
    out_of_scope: str = ""


@dataclass(frozen=True)
class Handler:
    parse: Callable[[Any], Any]
    apply: Callable[[Any, Event], None]


_handlers: dict[str, Handler] = {}
Apply = TypeVar("Apply", bound=Callable[[Any, Event], None])


def webhook_handler(*event_types: str, parse: Callable[[Any], Any]) -> Callable[[Apply], Apply]:
    """Act on events of ``event_types`` (replacing any handler they had).

    ``parse(data.object)`` runs before anything is stored; ``WebhookRejected`` there is a 400.
    A thin event has no ``data``: ``parse`` gets stripe-python's ``EventNotification`` of it
    (``webhooks.stripe.event_notification``), whose ``related_object`` and ``context`` name what
    a task fetches through the API (the notification itself calls nothing in the request).
    The decorated ``apply(parsed, event)`` runs in the transaction that stores the event, and
    must be idempotent (a reprocess applies it again) and never move state backwards."""

    def declare(apply: Apply) -> Apply:
        for event_type in event_types:
            _handlers[event_type] = Handler(parse=parse, apply=apply)
        return apply

    return declare


def handler_for(event_type: str) -> Handler | None:
    return _handlers.get(event_type)


def handled_types() -> list[str]:
    """The event types with a handler, sorted."""
    return sorted(_handlers)


def event_apply(event: Event) -> None:
    """Apply a handled event (in the caller's transaction); an unhandled one changes nothing."""
    handler = _handlers.get(event.type)
    if event.handled and handler is not None:
        handler.apply(event.data, event)


_TIMESTAMP = re.compile(r"[0-9]{1,12}")
THIN_EVENT = "v2.core.event"  # a thin event's ``object``; a snapshot event's is "event"


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


# --- Reading the fields of a Stripe object (the handlers use them) ---


def field_text(obj: dict[str, Any], key: str, *, limit: int = 1000) -> str:
    """A free-text field, made storable (lone surrogates replaced, NUL dropped)."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebhookRejected(f"data.object.{key} is not a string")
    if len(value) > limit:
        raise WebhookRejected(f"data.object.{key} is too long")
    return text_storable(value)


def field_int(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise WebhookRejected(f"{key} is not a non-negative integer")
    return value


_MAX_EPOCH = 253402300799  # 9999-12-31T23:59:59Z


def field_epoch(obj: dict[str, Any], key: str) -> datetime | None:
    value = field_int(obj, key)
    if value is None:
        return None
    if value > _MAX_EPOCH:
        raise WebhookRejected(f"{key} is not a plausible timestamp")
    return datetime.fromtimestamp(value, tz=UTC)


def field_iso_time(obj: dict[str, Any], key: str) -> datetime | None:
    """An ISO 8601 time ("2024-09-26T17:46:22.134Z", or with an offset), in UTC; one without an
    offset is UTC already, as Stripe's times are."""
    value = obj.get(key)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WebhookRejected(f"{key} is not an ISO 8601 time") from exc


def name_valid(value: Any) -> TypeGuard[str]:
    """An identifier we key on: 1-255 printable characters (no lone surrogates), no surrounding
    spaces."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 255
        and value.strip() == value
        and value.isprintable()
    )


def event_scope_check(*, livemode: bool, account: Any) -> str:
    """Why ``STRIPE_LIVEMODE`` or ``STRIPE_ACCOUNT`` excludes this event, or "" if neither."""
    mode = settings.STRIPE_LIVEMODE
    if mode != "any" and livemode != (mode == "live"):
        return f"{'live' if livemode else 'test'}-mode event; STRIPE_LIVEMODE is {mode}"
    wanted = settings.STRIPE_ACCOUNT
    if wanted and account != wanted:
        # The account is the sender's text: repr() keeps it printable and storable.
        whose = "the platform" if account is None else f"account {str(account)[:64]!r}"
        return f"event for {whose}; STRIPE_ACCOUNT is {wanted}"
    return ""


class _NoCalls(stripe.HTTPClient):
    """The HTTP client of a notification read while a delivery is taken: it calls nothing (a
    webhook is answered in milliseconds), its ``fetch_*`` methods raise ``APIConnectionError``.
    A task that fetches reads the stored event again with ``stripe_client()``."""

    name = "none: no call while a webhook is taken"

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        post_data: Any = None,
        *,
        _usage: list[str] | None = None,
    ) -> tuple[str, int, Mapping[str, str]]:
        raise stripe.APIConnectionError(
            f"no call to the Stripe API while a webhook is taken ({method.upper()} {url})",
            should_retry=False,
        )

    def close(self) -> None:
        return None


# An empty key (stripe-python refuses only a missing one): no request leaves this client.
_NO_CALLS = stripe.StripeClient("", http_client=_NoCalls(), max_network_retries=0)


def event_notification(
    data: dict[str, Any], *, client: stripe.StripeClient | None = None
) -> EventNotification:
    """A verified thin event as stripe-python reads it: the ``EventNotification`` class of its
    type, ``UnknownEventNotification`` for a type stripe-python does not know; with ``client``,
    its ``fetch_*`` methods call the API. ``WebhookRejected`` if stripe-python cannot read it.

    This is what ``StripeClient.parse_event_notification`` does once its ``verify_header`` has
    passed. ``parse_event_notification_without_verification`` is not used: it first unwraps a
    cloud provider's envelope (a ``detail`` key, or ``specversion`` and ``data``), so such a
    body would be read as another event than the one stored under its id."""
    try:
        return EventNotification.from_json(data, client or _NO_CALLS)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # The exception names only stripe-python's keys and types, never the sender's text.
        raise WebhookRejected(
            f"stripe-python cannot read this thin event: {type(exc).__name__} {exc}"[:200]
        ) from exc


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
    if not name_valid(event_id):
        raise WebhookRejected(
            "event has no id" if event_id in (None, "") else "event id is malformed"
        )
    if not name_valid(event_type):
        raise WebhookRejected(
            "event has no type" if event_type in (None, "") else "event type is malformed"
        )
    thin = data.get("object") == THIN_EVENT
    created = field_iso_time(data, "created") if thin else field_epoch(data, "created")
    # Recorded, never keyed on: one we cannot store is recorded as "", not refused.
    version = data.get("api_version")
    api_version = version if name_valid(version) and len(version) <= 64 else ""
    # Only an explicit true is live: with STRIPE_LIVEMODE=live, anything else is ignored.
    livemode = data.get("livemode") is True
    out_of_scope = event_scope_check(
        livemode=livemode, account=data.get("context" if thin else "account")
    )
    event = Event(
        id=event_id,
        type=event_type,
        created=created or datetime.fromtimestamp(signed_at, tz=UTC),
        livemode=livemode,
        api_version=api_version,
        out_of_scope=out_of_scope,
    )
    handler = handler_for(event_type)
    if handler is None or out_of_scope:
        return event
    if thin:
        obj: Any = event_notification(data)
    else:
        inner = data.get("data")
        obj = inner.get("object") if isinstance(inner, dict) else None
    return dataclasses.replace(event, handled=True, data=handler.parse(obj))
