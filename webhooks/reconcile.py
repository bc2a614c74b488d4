"""Events Stripe never delivered, recorded from its Events API: the job
``stripe-events-reconcile`` (every 10 minutes, under its lock) and ``manage.py stripe_reconcile``
(one run, now).

A webhook is a hint: Stripe retries a failing endpoint for three days and does not send the
events of a disabled one; its Events API keeps every event for 30 days. A run lists the events
of the handled types created since the cursor, less ``OVERLAP`` (an event is listed a little
after it is created), newest first, page after page (``has_more``, ``starting_after``), and
records each through the webhook's own path (``webhook_event_record``): one row per event id,
so an event listed here and delivered too, before or after, is one row and one email. It does
not ask for ``delivery_success=false``: every event is listed, the row says whether we have it.

A run makes at most ``CALLS_PER_RUN`` calls; a longer walk goes on at the next run from the last
event it recorded. When a walk reaches its end the cursor moves to the time the walk started.
A failed call ends the run with one log line and moves nothing past what was recorded; the
next run tries again, not before the time a 429's ``Retry-After`` gave. An answer that is not
Stripe's list of events, or an event that does not parse, is such a failure.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import stripe
from django.db.models import F
from django.utils import timezone
from stripe.params import EventListParams

from asyncwork.jobs import job
from webhooks.events import WebhookRejected, handled_types
from webhooks.models import EventsCursor, WebhookEvent
from webhooks.services import webhook_event_record
from webhooks.stripe import event_parse
from webhooks.stripe_api import stripe_client, stripe_error_sorted

logger = logging.getLogger(__name__)

JOB = "stripe-events-reconcile"
OVERLAP = timedelta(minutes=10)
PAGE_SIZE = 100  # the most Stripe lists at once
CALLS_PER_RUN = 10
# A 429 without Retry-After: wait this long.
RATE_LIMITED_WAIT = timedelta(seconds=60)


class NotStripesList(Exception):
    """An answer that is not the list of events Stripe documents."""


@dataclass(frozen=True)
class Reconciled:
    """What one run did."""

    calls: int = 0
    listed: int = 0
    recovered: int = 0  # listed, and not stored before: recorded by this run
    walk_ended: bool = False  # the cursor moved
    covered_until: datetime | None = None
    failure: str = ""  # why the run stopped before the walk's end, or why it did not run

    def __str__(self) -> str:
        if not self.calls:
            return self.failure
        done = f"{self.calls} call(s), {self.listed} event(s) listed, {self.recovered} recovered"
        if self.failure:
            return f"{done}; stopped: {self.failure}"
        if not self.walk_ended:
            return f"{done}; the walk goes on at the next run"
        until = f"{self.covered_until:%Y-%m-%d %H:%M:%S} UTC"
        return f"{done}; every event created before {until} is recorded"


def _page(
    client: stripe.StripeClient, params: EventListParams
) -> tuple[list[dict[str, Any]], bool]:
    """One page of events, as Stripe sent each, and whether more follow; ``NotStripesList``."""
    answer = client.v1.events.list(params=params).last_response
    data = answer.data if answer is not None else None
    if not isinstance(data, dict) or data.get("object") != "list":
        raise NotStripesList("the answer is not a list object")
    events, has_more = data.get("data"), data.get("has_more")
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise NotStripesList("the list's data is not a list of objects")
    if not isinstance(has_more, bool) or (has_more and not events):
        raise NotStripesList("the list's has_more is not true or false after its data")
    return events, has_more


def _record(obj: dict[str, Any]) -> bool:
    """Record one listed event as a delivery would be; whether it was not stored before."""
    body = json.dumps(obj, indent=2)
    try:
        event = event_parse(payload=body.encode(), signed_at=int(time.time()))
    except WebhookRejected as exc:
        raise NotStripesList(f"event {str(obj.get('id'))[:64]!r}: {exc.reason}") from exc
    recorded = webhook_event_record(
        event=event,
        body=body,
        headers={"Source": "Stripe Events API"},
        source=WebhookEvent.Source.EVENTS_API,
    )
    return not recorded.duplicate


@job(JOB, every=timedelta(minutes=10))
def stripe_events_reconcile() -> Reconciled:
    """One run (its job's lock held): walk on, record what is missing, keep how far it got.
    What it did (``str`` of the result) is its ``ScheduledJob`` row's ``last_result``."""
    client = stripe_client()
    if client is None:  # said once as a worker starts (``webhooks.stripe_api``)
        return Reconciled(failure="off")
    cursor, _ = EventsCursor.objects.get_or_create(name=JOB)
    now = timezone.now()
    if cursor.not_before is not None and cursor.not_before > now:
        return Reconciled(
            failure=f"Stripe asked to wait (429) until {cursor.not_before:%H:%M:%S} UTC"
        )
    if cursor.walk_started_at is None:
        cursor.walk_started_at, cursor.walk_after = now, ""
    since = (cursor.covered_until or cursor.walk_started_at) - OVERLAP
    params: EventListParams = {
        "types": handled_types(),
        "created": {"gte": int(since.timestamp())},
        "limit": PAGE_SIZE,
    }
    calls = listed = recovered = 0
    failure, walk_ended, not_before = "", False, None
    while calls < CALLS_PER_RUN and not walk_ended:
        if cursor.walk_after:
            params["starting_after"] = cursor.walk_after
        calls += 1
        try:
            events, has_more = _page(client, params)
            for obj in events:
                recovered += _record(obj)
                listed += 1
                cursor.walk_after = obj["id"]
        except stripe.RateLimitError as exc:
            wait = (exc.headers or {}).get("retry-after", "")
            not_before = timezone.now() + (
                timedelta(seconds=int(wait)) if wait.isdigit() else RATE_LIMITED_WAIT
            )
            failure = str(stripe_error_sorted(exc, doing="listing events"))
        except stripe.StripeError as exc:
            failure = str(stripe_error_sorted(exc, doing="listing events"))
        except NotStripesList as exc:
            failure = f"Stripe API, listing events: {exc}"
        if failure:
            break
        if not has_more:
            walk_ended = True
            cursor.covered_until, cursor.walk_started_at = cursor.walk_started_at, None
            cursor.walk_after = ""

    result = Reconciled(calls, listed, recovered, walk_ended, cursor.covered_until, failure)
    if failure:
        logger.error("stripe events reconcile stopped: %s", result, extra={"job": JOB})
    cursor.not_before, cursor.last_error = not_before, failure
    cursor.last_recovered = recovered
    cursor.recovered_total = F("recovered_total") + recovered
    cursor.save()
    return result
