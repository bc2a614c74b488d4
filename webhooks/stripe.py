"""Stripe's webhook: ``POST /webhooks/stripe/`` (``StripeWebhookView``) verifies a delivery, sheds
it under backpressure, stores it once and answers. Every answer other than 200 stores nothing; a
200 is sent only after the event committed, and says whether a handler acted on the delivery
(``handled``): its handler runs in the transaction that stores the event, so the answer knows
without waiting for anything it enqueued.

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

Storing: a verified delivery is stored once, under the provider's event id, together with its
handler's effect, in one transaction (``webhook_event_record``). The row is inserted with
``ON CONFLICT (event_id) DO NOTHING``: a duplicate delivery, even a concurrent one, changes
nothing. An out-of-scope event is stored as ``ignored`` with the reason in ``error`` and answered
200: refusing it would only have the provider retry it for days.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeGuard, TypeVar

import stripe
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import Counter
from stripe.v2.core import EventNotification

from asyncwork.audit import operator_action_record
from asyncwork.contrib.backpressure import backpressure_shed
from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.db import insert_or_skip, text_storable
from asyncwork.logging import log_context
from webhooks.models import WebhookEvent

logger = logging.getLogger(__name__)


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


# --- Storing a delivery once, and reprocessing stored ones ---------------------------------------
# Request headers kept with each delivery (lower-case WSGI names -> stored names).
KEPT_HEADERS = {
    "HTTP_STRIPE_SIGNATURE": "Stripe-Signature",
    "HTTP_USER_AGENT": "User-Agent",
    "CONTENT_TYPE": "Content-Type",
    "HTTP_X_FORWARDED_FOR": "X-Forwarded-For",
    "REMOTE_ADDR": "Remote-Addr",
}


@dataclass(frozen=True)
class Recorded:
    event_id: str
    duplicate: bool
    state: str


def webhook_event_record(
    *, event: Event, body: str, headers: dict[str, str], source: str = WebhookEvent.Source.WEBHOOK
) -> Recorded:
    """Store a verified event and apply it, or recognise it as a duplicate and do nothing;
    ``source``: how it reached us (a webhook, or the Events API)."""
    row = WebhookEvent(
        event_id=event.id,
        source=source,
        type=event.type,
        livemode=event.livemode,
        api_version=event.api_version,
        body=body,
        headers=headers,
        state=WebhookEvent.State.PROCESSED if event.handled else WebhookEvent.State.IGNORED,
        error=event.out_of_scope,
    )
    with transaction.atomic():
        if not insert_or_skip(row, conflict_fields=["event_id"]):
            logger.info("duplicate webhook delivery", extra={"event_id": event.id})
            return Recorded(event_id=event.id, duplicate=True, state="duplicate")
        if event.out_of_scope:
            # Worth a look: a secret of the other mode, or another account's, reaches us.
            logger.warning(
                "webhook event ignored: %s",
                event.out_of_scope,
                extra={"event_id": event.id, "event_type": event.type},
            )
        event_apply(event)
    return Recorded(event_id=event.id, duplicate=False, state=row.state)


@dataclass(frozen=True)
class Reprocessed:
    """What a reprocess did, by provider event id."""

    processed: list[str]
    ignored: list[str]  # a type we do not act on
    failed: list[str]  # the reason is on the row's ``error``
    missing: list[str]  # no such event stored (deleted by retention meanwhile)


WEBHOOK_EVENT_REPROCESS = "webhook_event.reprocess"


def webhook_event_reprocess(*, event_ids: Iterable[str], actor: str) -> Reprocessed:
    """Apply stored deliveries again (the admin's "Reprocess"), in the order received, each in
    its own transaction under its row's lock and recorded as an operator action. The body is
    parsed again but not re-verified; handlers are idempotent, so an applied event changes
    nothing. Each row ends ``processed``, ``ignored`` or ``failed`` (reason in ``error``)."""
    wanted = set(event_ids)
    order = list(
        WebhookEvent.objects.filter(event_id__in=wanted)
        .order_by("received_at", "pk")
        .values_list("event_id", flat=True)
    )
    outcome: dict[str, list[str]] = {state: [] for state in WebhookEvent.State.values}
    missing = sorted(wanted - set(order))
    for event_id in order:
        with transaction.atomic():
            row = WebhookEvent.objects.select_for_update().filter(event_id=event_id).first()
            if row is None:
                missing.append(event_id)
                continue
            before = row.state
            row.state, row.error = _reapply(row)
            row.save(update_fields=["state", "error"])
            operator_action_record(
                action=WEBHOOK_EVENT_REPROCESS,
                actor=actor,
                target=row,
                detail=f"{before} -> {row.state}" + (f": {row.error}" if row.error else ""),
            )
        outcome[row.state].append(event_id)
    result = Reprocessed(
        processed=outcome[WebhookEvent.State.PROCESSED],
        ignored=outcome[WebhookEvent.State.IGNORED],
        failed=outcome[WebhookEvent.State.FAILED],
        missing=missing,
    )
    logger.info(
        "reprocessed %d webhook event(s)",
        len(order) - len(missing),
        extra={"actor": actor, **dataclasses.asdict(result)},
    )
    return result


_SIGNED_AT = re.compile(r"(?:^|,)\s*t=([0-9]{1,12})\s*(?:,|$)")


def _reapply(row: WebhookEvent) -> tuple[str, str]:
    """Parse and apply one stored event; its new state and error."""
    if row.body_cleared_at is not None:
        return WebhookEvent.State.FAILED, (
            "its raw body was cleared by retention (WEBHOOK_BODY_RETENTION_DAYS); nothing to apply"
        )
    # The signature's timestamp, as on arrival (the event's time if its body has none).
    match = _SIGNED_AT.search(str(row.headers.get("Stripe-Signature", "")))
    signed_at = int(match.group(1)) if match else int(row.received_at.timestamp())
    try:
        # A savepoint: an apply that fails half-way leaves nothing behind.
        with transaction.atomic():
            event = event_parse(payload=row.body.encode(), signed_at=signed_at)
            if event.id != row.event_id:
                raise WebhookRejected(f"the body is event {event.id}, not {row.event_id}")
            if not event.handled:
                return WebhookEvent.State.IGNORED, event.out_of_scope
            event_apply(event)
    except WebhookRejected as exc:
        error = exc.reason
    except DatabaseError as exc:
        error = repr(exc)
    else:
        logger.info("webhook event reapplied", extra={"event_id": row.event_id})
        return WebhookEvent.State.PROCESSED, ""
    logger.warning("webhook event reprocessing failed: %s", error, extra={"event_id": row.event_id})
    return WebhookEvent.State.FAILED, error[:2000]


# Webhook deliveries by outcome, and events acted on in another Stripe API version than
# STRIPE_API_VERSION, counted in the web process (summed over gunicorn's workers through
# PROMETHEUS_MULTIPROC_DIR). Every label value is one of a bounded set: an event's api_version
# (the sender's text) becomes a label only when a handler applied the event and it reads as
# Stripe's versions read; any other text is counted as ``other``.
WEBHOOK_DELIVERIES = Counter(
    metric_name("webhook_deliveries"),
    "Webhook deliveries by outcome: accepted, duplicate, rejected (reason: why), shed"
    " (reason: backpressure level), unavailable (database down).",
    ["outcome", "reason"],
)

WEBHOOK_OTHER_API_VERSION = Counter(
    metric_name("webhook_other_api_version_events"),
    "Webhook events a handler applied whose api_version is not STRIPE_API_VERSION, by that"
    " version (other: one that does not read as a Stripe API version).",
    ["api_version"],
)
# A release date, with the release's name since 2024 ("2024-06-20", "2025-09-30.clover").
STRIPE_VERSION = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:\.[a-z]{1,32})?")
OTHER = "other"

# Each series' child, looked up once (``labels()`` costs more than the increment); filled on
# first use, as in multiprocess mode each child is a file.
_webhook_series: dict[tuple[str, str], Any] = {}


def webhook_delivery_count(outcome: str, reason: str = "") -> None:
    """One webhook delivery answered with ``outcome`` (reasons are fixed strings)."""
    child = _webhook_series.get((outcome, reason))
    if child is None:
        child = _webhook_series.setdefault(
            (outcome, reason), WEBHOOK_DELIVERIES.labels(outcome=outcome, reason=reason)
        )
    child.inc()


def other_api_version_count(api_version: str) -> None:
    """One event a handler applied, rendered in ``api_version``: counted when that is neither
    ``STRIPE_API_VERSION`` nor missing, under its own label only if it reads as Stripe's."""
    if api_version in ("", settings.STRIPE_API_VERSION):
        return
    label = api_version if STRIPE_VERSION.fullmatch(api_version) else OTHER
    WEBHOOK_OTHER_API_VERSION.labels(api_version=label).inc()


# --- The endpoint -------------------------------------------------------------------------------
# Stripe retries on its own schedule; this spaces out any other sender.
RETRY_AFTER_SECONDS = 30


def _reject(reason: str, status: int) -> JsonResponse:
    webhook_delivery_count("rejected", reason)
    logger.warning("webhook rejected: %s", reason, extra={"reason": reason, "status": status})
    response = JsonResponse({"error": reason}, status=status)
    # Logged above: keeps django.request from adding "Bad Request: ..." (log_response's flag).
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _retry_later(error: str) -> JsonResponse:
    """Not taken, nothing stored: the provider is to deliver it again later."""
    response = JsonResponse({"error": error}, status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


@method_decorator(csrf_exempt, name="dispatch")
class StripeWebhookView(View):
    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> JsonResponse:
        limit = settings.WEBHOOK_MAX_BODY_BYTES
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _reject("invalid Content-Length", 400)
        if length > limit:
            return _reject(f"body larger than {limit} bytes", 413)
        payload = request.read(limit + 1)
        if len(payload) > limit:
            return _reject(f"body larger than {limit} bytes", 413)
        if not payload:
            return _reject("empty body", 400)
        try:
            signed_at = signature_verify(
                payload=payload,
                header=request.headers.get("Stripe-Signature"),
                secrets=settings.STRIPE_WEBHOOK_SECRETS,
                tolerance=settings.STRIPE_WEBHOOK_TOLERANCE,
            )
            event = event_parse(payload=payload, signed_at=signed_at)
        except WebhookRejected as exc:
            return _reject(exc.reason, exc.status)
        # Every line logged from here on, down to the outbox publish, carries the event id.
        with log_context(event_id=event.id):
            return self._take(request, event=event, payload=payload)

    def _take(self, request: HttpRequest, *, event: Event, payload: bytes) -> JsonResponse:
        """Shed, or store once and acknowledge, a verified event."""
        # Only now is the type known, and nothing is stored yet.
        shed = backpressure_shed(essential=event.handled)
        if shed is not None:
            webhook_delivery_count("shed", str(shed))
            logger.warning(
                "webhook shed under backpressure (%s); the provider will redeliver it",
                shed,
                extra={"event_id": event.id, "event_type": event.type, "level": str(shed)},
            )
            return _retry_later("overloaded")

        headers = {
            name: text_storable(str(request.META[meta]))[:2000]
            for meta, name in KEPT_HEADERS.items()
            if meta in request.META
        }
        try:
            recorded = webhook_event_record(
                event=event, body=payload.decode("utf-8"), headers=headers
            )
        except (OperationalError, InterfaceError) as exc:
            webhook_delivery_count("unavailable")
            logger.error(
                "database unavailable; asking the provider to retry",
                extra={"event_id": event.id, "error": repr(exc)},
            )
            return _retry_later("temporarily unavailable")
        webhook_delivery_count("duplicate" if recorded.duplicate else "accepted")
        if not recorded.duplicate and event.handled:
            # Only an event acted on: an ignored one, whatever it says, changes no series.
            other_api_version_count(event.api_version)
        return JsonResponse(
            {
                "received": True,
                "event_id": recorded.event_id,
                "type": event.type,
                "duplicate": recorded.duplicate,
                # A duplicate changes nothing: the first delivery's answer said whether it acted.
                "handled": event.handled and not recorded.duplicate,
            }
        )
