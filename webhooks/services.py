"""The webhook guarantee: a verified delivery is stored once, under the provider's event id,
together with its handler's effect, in one transaction.

The row is inserted with ``ON CONFLICT (event_id) DO NOTHING``: a duplicate delivery, even a
concurrent one, changes nothing. An out-of-scope event is stored as ``ignored`` with the reason
in ``error`` and answered 200: refusing it would only have the provider retry it for days.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from prometheus_client import Counter

from asyncwork.audit import operator_action_record
from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.db import insert_or_skip
from webhooks.models import WebhookEvent
from webhooks.stripe import Event, WebhookRejected, event_apply, event_parse

logger = logging.getLogger(__name__)

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
