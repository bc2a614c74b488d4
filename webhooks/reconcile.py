"""Events Stripe never delivered, recorded from its Events API: the job
``stripe-events-reconcile`` (every 10 minutes, under its lock) and ``manage.py stripe_reconcile``
(one run, now; ``--since`` reaches further back).

A webhook is a hint: Stripe retries a failing endpoint for three days and does not send the
events of a disabled one; its Events API keeps every event for 30 days. A walk lists the events
of the handled types created since its start time, newest first, page after page (``has_more``,
``starting_after``), and records each through the webhook's own path
(``webhook_event_record``): one row per event id, so an event listed here and delivered too,
before or after, is one row and one email. It does not ask for ``delivery_success=false``: every
event is listed, the row says whether we have it.

The first walk lists back ``RETRY_WINDOW``, the three days in which Stripe may still be retrying
(or have given up on) an event this application never took; each later walk from where the last
ended, less ``OVERLAP`` (an event is listed a little after it is created). ``--since`` moves a
walk's start further back, as far as the ``EVENTS_KEPT`` days the API lists; the walk under way
goes on past where it would have stopped. When a walk ends, every event created from
``covered_from`` to ``covered_until`` (the time the walk started) is recorded.

A run makes at most ``CALLS_PER_RUN`` calls; a longer walk goes on at the next run from the last
event it recorded. A failed call ends the run with one log line and moves nothing past what was
recorded; the next run tries again, not before the time a 429's ``Retry-After`` gave. An answer
that is not Stripe's list of events, or an event that does not parse, is such a failure.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import stripe
from django.db.models import F
from django.utils import timezone
from stripe.params import EventListParams

from asyncwork.contrib.periodic.jobs import job
from webhooks.models import EventsCursor, WebhookEvent
from webhooks.stripe import WebhookRejected, event_parse, handled_types, webhook_event_record
from webhooks.stripe_api import stripe_client, stripe_error_sorted

logger = logging.getLogger(__name__)

JOB = "stripe-events-reconcile"
OVERLAP = timedelta(minutes=10)
# "Stripe automatically resends the undelivered events to your endpoint for up to three days"
# and "only returns events created in the last 30 days"
# (docs.stripe.com/webhooks/process-undelivered-events).
RETRY_WINDOW = timedelta(days=3)
EVENTS_KEPT = timedelta(days=30)
PAGE_SIZE = 100  # the most Stripe lists at once
CALLS_PER_RUN = 10
# A 429 without Retry-After: wait this long.
RATE_LIMITED_WAIT = timedelta(seconds=60)
# Why a run did not run: no STRIPE_API_KEY.
OFF = "off"


class NotStripesList(Exception):
    """An answer that is not the list of events Stripe documents."""


TIME = "%Y-%m-%d %H:%M:%S"  # and " UTC": the times here are the database's, in UTC


@dataclass(frozen=True)
class Reconciled:
    """What one run did."""

    calls: int = 0
    listed: int = 0
    recovered: int = 0  # listed, and not stored before: recorded by this run
    walk_ended: bool = False  # the cursor moved
    walk_since: datetime | None = None  # the oldest creation time the walk lists
    covered_from: datetime | None = None
    covered_until: datetime | None = None
    failure: str = ""  # why the run stopped before the walk's end, or why it did not run

    @property
    def covered(self) -> str:
        """The span every walk so far covers, in words (once a walk has ended)."""
        return (
            f"every event created from {self.covered_from:{TIME}} "
            f"to {self.covered_until:{TIME}} UTC is recorded"
        )

    def __bool__(self) -> bool:
        """Whether the run found anything: events recovered, or a failure ("off", no API key, is
        none: a worker says it once as it starts). A run that found nothing is logged at DEBUG
        (``asyncwork.contrib.periodic.jobs.job_run``)."""
        return bool(self.recovered or self.failure not in ("", OFF))

    def __str__(self) -> str:
        if not self.calls:
            return self.failure
        done = f"{self.calls} call(s), {self.listed} event(s) listed, {self.recovered} recovered"
        if self.failure:
            return f"{done}; stopped: {self.failure}"
        if not self.walk_ended:
            return f"{done}; the walk back to {self.walk_since:{TIME}} UTC goes on at the next run"
        return f"{done}; {self.covered}"


def since_refusal(since: datetime, *, now: datetime) -> str:
    """Why no walk can list back to ``since``, or "" if one can."""
    oldest, since = now - EVENTS_KEPT, since.astimezone(UTC)
    if since < oldest:
        return (
            f"{since:{TIME}} UTC is more than {EVENTS_KEPT.days} days ago: Stripe's Events API "
            f"no longer has the events created then (it keeps them back to {oldest:{TIME}} UTC)"
        )
    if since > now:
        return f"{since:{TIME}} UTC is in the future"
    return ""


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


def _walk_start(cursor: EventsCursor, now: datetime) -> datetime:
    """Where a new walk starts: the retry window if none ended before, else an overlap before the
    last one's end, never before what the API still lists."""
    if cursor.covered_until is None:
        return now - RETRY_WINDOW
    return max(cursor.covered_until - OVERLAP, now - EVENTS_KEPT)


@job(JOB, every=timedelta(minutes=10))
def stripe_events_reconcile(since: datetime | None = None) -> Reconciled:
    """One run (its job's lock held): walk on, record what is missing, keep how far it got;
    ``since`` (checked by ``since_refusal``): the walk lists back to then at least. What it did
    (``str`` of the result) is its ``ScheduledJob`` row's ``last_result``."""
    client = stripe_client()
    if client is None:  # said once as a worker starts (``webhooks.stripe_api``)
        return Reconciled(failure=OFF)
    cursor, _ = EventsCursor.objects.get_or_create(name=JOB)
    now = timezone.now()
    if cursor.not_before is not None and cursor.not_before > now:
        return Reconciled(
            failure=f"Stripe asked to wait (429) until {cursor.not_before:%H:%M:%S} UTC"
        )
    if cursor.walk_since is None:
        cursor.walk_started_at, cursor.walk_after = now, ""
        cursor.walk_since = _walk_start(cursor, now)
    if since is not None and since < cursor.walk_since:
        # Newest first: the pages after ``walk_after`` now go on further back.
        cursor.walk_since = since
    walk_since = cursor.walk_since
    params: EventListParams = {
        "types": handled_types(),
        "created": {"gte": int(walk_since.timestamp())},
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
            covered_from, covered_until = cursor.covered_from, cursor.covered_until
            if covered_from and covered_until and walk_since <= covered_until:
                cursor.covered_from = min(covered_from, walk_since)
            else:  # the first walk, or one that does not reach the last (off over 30 days)
                cursor.covered_from = walk_since
            cursor.covered_until, cursor.walk_started_at = cursor.walk_started_at, None
            cursor.walk_since, cursor.walk_after = None, ""

    result = Reconciled(
        calls=calls,
        listed=listed,
        recovered=recovered,
        walk_ended=walk_ended,
        walk_since=walk_since,
        covered_from=cursor.covered_from,
        covered_until=cursor.covered_until,
        failure=failure,
    )
    if failure:
        logger.error("stripe events reconcile stopped: %s", result, extra={"job": JOB})
    cursor.not_before, cursor.last_error = not_before, failure
    cursor.last_recovered = recovered
    cursor.recovered_total = F("recovered_total") + recovered
    cursor.save()
    return result
