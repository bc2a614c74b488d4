"""The events reconcile (``webhooks.reconcile``) against the kit's stand-in of the Stripe API
(``stack.stripe_api``), read by the real stripe-python client, with a real worker and the kit's
SMTP server:

* an endpoint down longer than Stripe retries (the events exist only in the API): one run and
  each paid invoice is emailed once; the same events delivered late by webhook are duplicates;
* the first run reaches back over the three days Stripe retries for, ``--since`` back over the
  30 days its Events API keeps, and no further, in one line;
* a walk of three pages, and one longer than a run's calls, which goes on at the next run, as
  does a walk ``--since`` moved further back while under way;
* the API answering 500, 429 with Retry-After, nothing in time, or not JSON: the run stops
  with one log line, the cursor moves only over what was recorded, the next run finishes,
  nothing is lost and nothing is sent twice;
* without a key it is off, and says so; the operator sees each run on /health/,
  ``pipeline_status``, /metrics and the dashboard, and each recovered event in the admin.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import timedelta
from io import StringIO
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.core.management import CommandError, call_command
from django.core.serializers.json import DjangoJSONEncoder
from django.test import Client
from django.utils import timezone

from asyncwork.contrib.monitoring.health import health_report
from invoicing.models import EmailDelivery, Invoice
from stack import stripe_events
from stack.smtp import SmtpServer
from stack.stripe_api import RATE_LIMITED, StripeApi
from tests.helpers.dashboard import dashboard
from tests.helpers.factories import staff_user
from tests.helpers.metrics import scrape, value
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import API_FAULT_WORDS, paid_event, post_event
from webhooks import reconcile
from webhooks.models import EventsCursor, WebhookEvent
from webhooks.stripe_api import API_OFF

pytestmark = pytest.mark.django_db(transaction=True)


def undelivered(stripe_api: StripeApi, invoices: int) -> list[dict[str, Any]]:
    """``invoices`` paid invoices, each with its invoice.paid and invoice.payment_succeeded
    event, and an event of a type not handled, which Stripe could not deliver; the events."""
    events = []
    for n in range(invoices):
        paid = paid_event(customer_email=f"customer{n}@example.com")
        succeeded = stripe_events.event("invoice.payment_succeeded", paid["data"]["object"])
        events += [paid, succeeded]
    events.append(stripe_events.event("customer.created", stripe_events.customer_object()))
    for event in events:
        stripe_api.event_add(event, delivered=False)
    return events


def run(*args: str) -> str:
    """``manage.py stripe_reconcile`` with ``args``; what it printed."""
    out = StringIO()
    call_command("stripe_reconcile", *args, stdout=out)
    return out.getvalue()


def listings(stripe_api: StripeApi) -> list[dict[str, list[str]]]:
    """The query of each call to List Events."""
    return [parse_qs(urlsplit(p).query) for p in stripe_api.requests if p.startswith("/v1/events")]


def test_events_stripe_never_delivered_are_emailed_once_and_a_late_delivery_is_a_duplicate(
    client: Client, smtp: SmtpServer, stripe_api: StripeApi
) -> None:
    events = undelivered(stripe_api, invoices=5)
    with worker_thread():
        said = run()
        pipeline_quiet()
        assert said.splitlines()[0] == (
            "10 event(s) listed in 1 call(s); 10 recovered (not stored before), 0 already stored"
        )
        assert said.splitlines()[1].startswith("cursor: every event created from ")
        # Stripe delivers them after all: each is a duplicate.
        for event in events:
            answer = post_event(client, stripe_events.encode(event))
            assert answer.status_code == 200, answer.content
            assert answer.json()["duplicate"] is (event["type"] != "customer.created")
        pipeline_quiet()

    assert sorted(m["To"] for m in smtp.messages) == [
        f"Jenny Rosen <customer{n}@example.com>" for n in range(5)
    ]
    assert EmailDelivery.objects.filter(state=EmailDelivery.State.SENT).count() == 5
    recovered = WebhookEvent.objects.filter(source=WebhookEvent.Source.EVENTS_API)
    assert recovered.count() == 10
    assert set(recovered.values_list("state", flat=True)) == {WebhookEvent.State.PROCESSED}
    # Asked for the handled types only, since the cursor less the overlap, all of them.
    (query,) = listings(stripe_api)
    assert query["types[0]"] + query["types[1]"] == ["invoice.paid", "invoice.payment_succeeded"]
    assert int(query["created[gte]"][0]) <= min(e["created"] for e in events) <= time.time()
    assert "delivery_success" not in query

    # The next run lists them again (the overlap) and records nothing new.
    assert run().splitlines()[0] == (
        "10 event(s) listed in 1 call(s); 0 recovered (not stored before), 10 already stored"
    )
    assert len(smtp.messages) == 5


HOUR, DAY = 3600, 86400


def paid_ago(stripe_api: StripeApi, invoices: int, seconds: int, who: str) -> list[dict[str, Any]]:
    """``invoices`` paid ``seconds`` ago, to ``who<n>@example.com``, whose events (invoice.paid
    and invoice.payment_succeeded) Stripe could not deliver; the events."""
    created = int(time.time()) - seconds
    events = []
    for n in range(invoices):
        paid = paid_event(customer_email=f"{who}{n}@example.com", created=created)
        obj = paid["data"]["object"]
        events += [paid, stripe_events.event("invoice.payment_succeeded", obj, created=created)]
    for event in events:
        stripe_api.event_add(event, delivered=False)
    return events


def recipients(smtp: SmtpServer) -> Counter[str]:
    return Counter(m["To"].addresses[0].addr_spec for m in smtp.messages)


def test_the_first_run_reaches_back_three_days_and_since_to_what_stripe_keeps(
    client: Client, smtp: SmtpServer, stripe_api: StripeApi
) -> None:
    an_hour = paid_ago(stripe_api, 25, HOUR, "hour")
    two_days = paid_ago(stripe_api, 3, 2 * DAY, "twodays")
    twenty_days = paid_ago(stripe_api, 2, 20 * DAY, "twentydays")
    paid_ago(stripe_api, 1, 31 * DAY, "gone")  # Stripe no longer has them: never listed

    with worker_thread():
        before = timezone.now()
        first = run().splitlines()
        pipeline_quiet()
        emailed = recipients(smtp)
        assert first[0] == (
            "56 event(s) listed in 1 call(s); 56 recovered (not stored before), 0 already stored"
        )
        cursor = EventsCursor.objects.get()
        assert cursor.covered_from is not None
        assert cursor.covered_until is not None
        assert cursor.covered_until - cursor.covered_from == reconcile.RETRY_WINDOW
        assert before <= cursor.covered_until <= timezone.now()
        assert first[1] == (
            f"cursor: every event created from {cursor.covered_from:%Y-%m-%d %H:%M:%S} "
            f"to {cursor.covered_until:%Y-%m-%d %H:%M:%S} UTC is recorded"
        )
        (query,) = listings(stripe_api)
        assert int(query["created[gte]"][0]) == int(cursor.covered_from.timestamp())

        since = (timezone.now() - timedelta(days=21)).replace(microsecond=0)
        second = run("--since", since.isoformat()).splitlines()
        pipeline_quiet()
        assert second[0] == (
            "60 event(s) listed in 1 call(s); 4 recovered (not stored before), 56 already stored"
        )
        cursor.refresh_from_db()
        assert cursor.covered_from == since
        assert second[1].startswith(f"cursor: every event created from {since:%Y-%m-%d %H:%M:%S} ")

        calls = len(stripe_api.requests)
        too_old = (timezone.now() - timedelta(days=31)).date().isoformat()
        with pytest.raises(CommandError) as refused:
            run("--since", too_old)
        assert str(refused.value).startswith(
            f"{too_old} 00:00:00 UTC is more than 30 days ago: Stripe's Events API no longer "
            "has the events created then (it keeps them back to "
        )
        assert "\n" not in str(refused.value)
        assert len(stripe_api.requests) == calls  # nothing asked

        # Stripe delivers them all after all: nothing more is sent.
        for event in an_hour + two_days + twenty_days:
            answer = post_event(client, stripe_events.encode(event))
            assert (answer.status_code, answer.json()["duplicate"]) == (200, True)
        pipeline_quiet()

    assert emailed == Counter(
        [f"hour{n}@example.com" for n in range(25)] + [f"twodays{n}@example.com" for n in range(3)]
    )
    assert recipients(smtp) == emailed + Counter(f"twentydays{n}@example.com" for n in range(2))
    assert EmailDelivery.objects.filter(state=EmailDelivery.State.SENT).count() == 30
    assert WebhookEvent.objects.filter(source=WebhookEvent.Source.EVENTS_API).count() == 60


@pytest.mark.parametrize(
    ("since", "words"),
    [
        ("yesterday", "--since 'yesterday' is not an ISO date or date and time: "),
        ("2026-02-30", "--since '2026-02-30' is not an ISO date or date and time: "),
        ("2999-01-01", "2999-01-01 00:00:00 UTC is in the future"),
    ],
)
def test_a_since_that_is_not_a_time_within_reach_is_one_line(
    stripe_api: StripeApi, since: str, words: str
) -> None:
    with pytest.raises(CommandError) as refused:
        run("--since", since)
    assert str(refused.value).startswith(words)
    assert stripe_api.requests == []
    assert not EventsCursor.objects.exists()


def test_since_moves_a_walk_under_way_further_back_and_the_job_finishes_it(
    client: Client, stripe_api: StripeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    recent = paid_ago(stripe_api, 3, HOUR, "recent")  # 6 events
    older = paid_ago(stripe_api, 2, 10 * DAY, "older")  # 4 more, before the first walk's start
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 2)
    monkeypatch.setattr(reconcile, "CALLS_PER_RUN", 1)
    run()  # the first walk's first page
    cursor = EventsCursor.objects.get()
    started = cursor.walk_started_at
    assert started is not None
    assert cursor.walk_since == started - reconcile.RETRY_WINDOW

    since = (timezone.now() - timedelta(days=12)).replace(microsecond=0)
    said = run("--since", since.isoformat()).splitlines()
    assert said[1] == (
        f"the walk back to {since:%Y-%m-%d %H:%M:%S} UTC goes on at the next run "
        "(a run makes at most 1 calls)"
    )
    assert health_report()[1]["checks"]["stripe_reconcile"]["walk_since"] == since
    viewer = Client()
    viewer.force_login(staff_user("watcher", groups=["viewers"]))
    figures = dashboard(viewer).figures["stripe_reconcile"]
    assert figures["walk under way"]["value"] == f"back to {since:%Y-%m-%d %H:%M:%S} UTC"
    assert figures["every event recorded"]["value"] == "-"

    runs = 0
    while EventsCursor.objects.get().walk_since is not None and runs < 10:
        reconcile.stripe_events_reconcile()  # the job's runs, every 10 minutes
        runs += 1

    cursor.refresh_from_db()
    assert (cursor.covered_from, cursor.covered_until) == (since, started)
    # One listing, newest first, each page once, on past where the first walk would have ended.
    newest_first = [e["id"] for e in recent[::-1] + older[::-1]]
    pages = listings(stripe_api)
    assert [q.get("starting_after", [""])[0] for q in pages] == ["", *newest_first[1:-1:2]]
    assert [int(q["created[gte]"][0]) for q in pages] == [
        int((started - reconcile.RETRY_WINDOW).timestamp()),
        *[int(since.timestamp())] * 4,
    ]
    assert WebhookEvent.objects.count() == 2 * Invoice.objects.count() == 10


def test_after_longer_off_than_stripe_keeps_the_span_covered_starts_again(
    stripe_api: StripeApi,
) -> None:
    paid_ago(stripe_api, 1, 29 * DAY, "kept")
    long_ago = timezone.now() - timedelta(days=40)
    EventsCursor.objects.create(
        name=reconcile.JOB, covered_from=long_ago - timedelta(days=3), covered_until=long_ago
    )
    said = run().splitlines()
    assert said[0].startswith("2 event(s) listed in 1 call(s); 2 recovered")
    cursor = EventsCursor.objects.get()
    assert cursor.covered_from is not None
    assert cursor.covered_until is not None
    # Listed from what Stripe still has; the days before it, gone, are not claimed as covered.
    assert cursor.covered_until - cursor.covered_from == reconcile.EVENTS_KEPT
    (query,) = listings(stripe_api)
    assert int(query["created[gte]"][0]) == int(cursor.covered_from.timestamp())


def test_three_pages_are_walked_and_a_walk_longer_than_a_run_goes_on_at_the_next(
    stripe_api: StripeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(250):
        stripe_api.event_add(paid_event(), delivered=False)

    monkeypatch.setattr(reconcile, "CALLS_PER_RUN", 2)
    said = run()
    cursor = EventsCursor.objects.get()
    assert cursor.walk_since is not None
    assert said.splitlines() == [
        "200 event(s) listed in 2 call(s); 200 recovered (not stored before), 0 already stored",
        f"the walk back to {cursor.walk_since:%Y-%m-%d %H:%M:%S} UTC goes on at the next run "
        "(a run makes at most 2 calls)",
    ]
    assert cursor.covered_until is None  # not moved: the walk has not ended
    assert cursor.walk_after == stripe_api.events[50]["id"]  # newest first: 249 down to 50

    said = run()
    assert said.splitlines()[0] == (
        "50 event(s) listed in 1 call(s); 50 recovered (not stored before), 0 already stored"
    )
    cursor.refresh_from_db()
    assert (cursor.walk_after, cursor.walk_started_at, cursor.walk_since) == ("", None, None)
    assert cursor.covered_until is not None
    assert cursor.recovered_total == 250
    pages = listings(stripe_api)
    assert [q.get("starting_after", [""])[0] for q in pages] == [
        "",
        stripe_api.events[150]["id"],
        stripe_api.events[50]["id"],
    ]
    assert {q["limit"][0] for q in pages} == {"100"}
    assert WebhookEvent.objects.count() == Invoice.objects.count() == 250


@pytest.mark.parametrize(("fault", "words"), API_FAULT_WORDS)
def test_a_failing_call_stops_the_run_in_one_line_and_the_next_run_loses_and_doubles_nothing(
    smtp: SmtpServer,
    stripe_api: StripeApi,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    words: str,
) -> None:
    undelivered(stripe_api, invoices=3)  # 6 events of the handled types: 3 pages of 2
    monkeypatch.setattr(reconcile, "PAGE_SIZE", 2)
    monkeypatch.setattr(reconcile, "CALLS_PER_RUN", 1)
    run()  # the first page
    cursor = EventsCursor.objects.get()
    first_page = cursor.walk_after
    assert first_page == stripe_api.events[4]["id"]  # newest first: 5, 4

    monkeypatch.setattr(reconcile, "CALLS_PER_RUN", 10)
    stripe_api.fail_next(fault)
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="webhooks.reconcile"),
        pytest.raises(CommandError) as stopped,
    ):
        run()
    assert str(stopped.value) == (
        f"stopped: Stripe API, listing events: {words}; the next run goes on from there"
    )
    (line,) = [r for r in caplog.records if r.name == "webhooks.reconcile"]
    assert line.levelno == logging.ERROR
    assert line.exc_info is None
    assert words in line.getMessage()
    cursor.refresh_from_db()
    assert (cursor.walk_after, cursor.covered_until) == (first_page, None)
    assert cursor.last_error == f"Stripe API, listing events: {words}"
    assert health_report()[1]["checks"]["stripe_reconcile"]["status"] == "degraded"

    if fault == RATE_LIMITED:
        # Retry-After honoured: no call before it has passed.
        calls = len(stripe_api.requests)
        with pytest.raises(CommandError, match=r"Stripe asked to wait \(429\) until "):
            run()
        assert len(stripe_api.requests) == calls
        time.sleep(stripe_api.retry_after)
    said = run()
    with worker_thread():  # the emails of what was recorded
        pipeline_quiet()

    assert said.splitlines()[0].startswith("4 event(s) listed in 2 call(s); 4 recovered")
    cursor.refresh_from_db()
    assert cursor.covered_until is not None
    assert cursor.last_error == ""
    assert WebhookEvent.objects.count() == 6
    assert sorted(m["To"] for m in smtp.messages) == [
        f"Jenny Rosen <customer{n}@example.com>" for n in range(3)
    ]


def test_an_event_that_does_not_parse_stops_the_run_before_it(
    stripe_api: StripeApi, caplog: pytest.LogCaptureFixture
) -> None:
    good = paid_event(created=int(time.time()) - 5)
    bad = paid_event()
    bad["data"]["object"]["id"] = ""
    stripe_api.event_add(good, delivered=False)
    stripe_api.event_add(bad, delivered=False)

    with pytest.raises(CommandError) as stopped:
        run()
    assert f"event '{bad['id']}': data.object.id is missing" in str(stopped.value)
    assert not WebhookEvent.objects.exists()  # the newest, bad, came first
    cursor = EventsCursor.objects.get()
    assert (cursor.walk_after, cursor.covered_until) == ("", None)


def test_without_a_key_it_is_off_and_says_so() -> None:
    with pytest.raises(CommandError) as off:
        run()
    assert str(off.value) == API_OFF
    assert str(reconcile.stripe_events_reconcile()) == "off"  # the job's run: said once at start
    assert not EventsCursor.objects.exists()
    check = health_report()[1]["checks"]["stripe_reconcile"]
    assert (check["status"], check["reconcile"], check["why"]) == ("ok", "off", API_OFF)


def test_the_operator_sees_each_run_and_each_recovered_event(
    stripe_api: StripeApi, settings: Any
) -> None:
    undelivered(stripe_api, invoices=2)
    EventsCursor.objects.create(name=reconcile.JOB, recovered_total=3)  # earlier runs
    before = timezone.now()
    run()

    check = health_report()[1]["checks"]["stripe_reconcile"]
    assert (check["status"], check["recovered_last_run"], check["recovered_total"]) == (
        "ok",
        4,
        7,
    )
    assert check["last_run"] >= before
    assert check["covered_until"] >= before
    # The first walk: the three days Stripe retries for, up to when it started.
    assert check["covered_until"] - check["covered_from"] == reconcile.RETRY_WINDOW
    assert check["walk_since"] is None
    assert check["last_run_did"].startswith("1 call(s), 4 event(s) listed, 4 recovered; ")

    screen = StringIO()
    call_command("pipeline_status", stdout=screen)
    (line,) = [row for row in screen.getvalue().splitlines() if "stripe_reconcile" in row]
    assert "recovered_total=7" in line
    assert "recovered_last_run=4" in line
    assert "stripe-events-reconcile" in screen.getvalue()  # the job's own row

    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": "a-monitoring-token"}
    monitor = Client(HTTP_AUTHORIZATION="Bearer a-monitoring-token")
    shown = monitor.get("/health/").json()["checks"]["stripe_reconcile"]
    assert shown["recovered_total"] == 7
    for moment in ("covered_from", "covered_until"):
        assert shown[moment] == DjangoJSONEncoder().default(check[moment])
    samples = scrape(monitor)
    assert value(samples, "invoicing_stripe_events_recovered_total") == 7
    assert 0 <= value(samples, "invoicing_stripe_reconcile_cursor_age_seconds") < 60 * 11

    viewer = Client()
    viewer.force_login(staff_user("watcher", groups=["viewers"]))
    figures = dashboard(viewer).figures["stripe_reconcile"]
    assert figures["recovered in the last run"]["value"] == "4"
    assert figures["recovered in all"]["value"] == "7"
    assert figures["last run"]["status"] == "ok"
    span = check["covered_from"], check["covered_until"]
    assert figures["every event recorded"][
        "value"
    ] == "{:%Y-%m-%d %H:%M:%S} to {:%Y-%m-%d %H:%M:%S} UTC".format(*span)
    assert figures["walk under way"]["value"] == "-"
    listed = viewer.get(figures["recovered in all"]["href"])
    assert listed.status_code == 200
    assert listed.context["cl"].result_count == 4  # the customer.created was not listed
    assert b"Events API (recovered by the reconcile)" in listed.content


@pytest.mark.parametrize(
    ("result", "found"),
    [
        (reconcile.Reconciled(failure=reconcile.OFF), False),
        (reconcile.Reconciled(calls=1, listed=3), False),
        (reconcile.Reconciled(calls=1, listed=3, recovered=1), True),
        (reconcile.Reconciled(calls=1, failure="Stripe answered 500 listing events"), True),
    ],
    ids=["off", "all-stored", "recovered", "failed"],
)
def test_a_run_found_something_when_it_recovered_events_or_failed(
    result: reconcile.Reconciled, found: bool
) -> None:
    """Its truth decides its job's line: INFO, or DEBUG for a run that found nothing."""
    assert bool(result) is found
