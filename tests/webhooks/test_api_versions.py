"""The Stripe API version of each event: stored on its row (a thin event has none), shown in the
admin, and an event of another version than ``STRIPE_API_VERSION`` taken all the same and
counted, in /metrics and in /health/'s details, which it never degrades. /metrics counts only
events a handler applied, under a version label only when it reads as Stripe's (else
``other``): however many versions signed events carry, the series stay few, scraped from a
real gunicorn after real signed deliveries. Against the real PostgreSQL; the health checks run
on connections of their own."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.conf import settings
from django.test import Client
from django.utils import timezone

from asyncwork.contrib.monitoring import health
from invoicing.models import Invoice
from stack import stripe_events
from tests.helpers.admin import admin_as, rows
from tests.helpers.factories import staff_user
from tests.helpers.metrics import (
    METRICS_URL,
    delta,
    multiprocess_gunicorn,
    parse,
    scrape,
    series,
)
from tests.helpers.stripe import WEBHOOK_URL, paid_event, post_event, post_signed
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)

OLDER = "2024-06-20"
COUNTER = "invoicing_webhook_other_api_version_events_total"
TOKEN = "api-versions-test-token"


def send(client: Client, api_version: Any, **invoice: Any) -> dict[str, Any]:
    """A paid invoice's event rendered in ``api_version`` (None: Stripe's null), posted."""
    event = paid_event(**invoice)
    event["api_version"] = api_version
    response = post_event(client, stripe_events.encode(event))
    assert response.status_code == 200, response.content
    return event


def test_the_default_is_the_version_the_handlers_and_their_events_are_written_for() -> None:
    assert settings.STRIPE_API_VERSION == stripe_events.API_VERSION == "2025-09-30.clover"


def test_each_event_s_version_is_stored_and_another_version_is_still_applied(
    client: Client,
) -> None:
    current = send(client, stripe_events.API_VERSION)
    older = send(client, OLDER, customer_email="older@example.com")
    unversioned = send(client, None)
    unreadable = send(client, {"not": "a version"})  # recorded as none, never refused
    thin = stripe_events.thin_event("v1.billing.meter.no_meter_found", None)
    assert post_event(client, stripe_events.encode(thin)).status_code == 200

    stored = dict(WebhookEvent.objects.values_list("event_id", "api_version"))
    assert stored == {
        current["id"]: stripe_events.API_VERSION,
        older["id"]: OLDER,
        unversioned["id"]: "",
        unreadable["id"]: "",
        thin["id"]: "",
    }
    assert WebhookEvent.objects.get(event_id=older["id"]).state == "processed"
    assert Invoice.objects.filter(customer_email="older@example.com").exists()


def ignored_event(api_version: str, *, livemode: bool = False) -> dict[str, Any]:
    """An event this endpoint stores and does not act on: a type with no handler, or (live)
    a payment of the mode it does not act on."""
    if livemode:
        event = paid_event()
        event["livemode"] = True
    else:
        event = stripe_events.event("customer.created", stripe_events.customer_object())
    event["api_version"] = api_version
    return event


def test_events_acted_on_in_another_version_are_counted_once_by_version(client: Client) -> None:
    before = scrape(client)
    send(client, stripe_events.API_VERSION)
    older = send(client, OLDER)
    assert post_event(client, stripe_events.encode(older)).json()["duplicate"] is True
    send(client, "2024-04-10.charon")
    send(client, "2024-04-10.Charon")  # not how Stripe writes a version
    for ignored in (ignored_event("2023-10-16"), ignored_event("2023-08-16", livemode=True)):
        assert post_event(client, stripe_events.encode(ignored)).status_code == 200
    after = scrape(client)

    assert delta(before, after, COUNTER, api_version=OLDER) == 1
    assert delta(before, after, COUNTER, api_version="2024-04-10.charon") == 1
    assert delta(before, after, COUNTER, api_version="other") == 1
    assert delta(before, after, COUNTER, api_version="2024-04-10.Charon") == 0
    assert delta(before, after, COUNTER, api_version=stripe_events.API_VERSION) == 0
    assert delta(before, after, COUNTER, api_version="2023-10-16") == 0
    assert delta(before, after, COUNTER, api_version="2023-08-16") == 0


# Versions a signed event may carry that do not read as Stripe's: each distinct, each stored.
JUNK_FORMS = [
    "junk-{i}",
    "2025-09-30.clover-{i}",
    "2025-09-30.Clover{i:c}",
    "2025-9-{i}",
    "v2025-09-{i:02d}",
    "2025-09-{i:02d}.clover.x",
    "\u0662\u0660\u0662\u0665-\u0660\u0669-{i:02d}",  # Arabic-Indic digits: not [0-9]
    "{i:010d}" + "x" * 54,
]


@pytest.mark.slow
def test_signed_events_cannot_grow_the_version_series(
    transactional_db: None, tmp_path: Path
) -> None:
    directory = tmp_path / "metrics-web"
    directory.mkdir()
    junk = [form.format(i=i) for form in JUNK_FORMS for i in range(65, 75)]
    # Well-formed versions on events nothing acts on: a type without a handler, the other mode.
    ignored = [ignored_event(f"2023-01-{day:02d}") for day in range(1, 21)]
    ignored += [ignored_event(f"2022-01-{day:02d}.acacia", livemode=True) for day in range(1, 21)]
    acted = [paid_event() for _ in junk]
    for event, version in zip(acted, junk, strict=True):
        event["api_version"] = version
    older = paid_event()
    older["api_version"] = OLDER
    with multiprocess_gunicorn(directory, log=tmp_path / "gunicorn.log") as url:
        for event in [*acted, *ignored, older, older]:
            response = post_signed(f"{url}{WEBHOOK_URL}", stripe_events.encode(event))
            assert response.status_code == 200, response.text
        samples = parse(requests.get(f"{url}{METRICS_URL}", timeout=10).text)

    assert len(set(junk)) == len(junk) == 80
    # Every event taken and stored with the version it carried; two series in all.
    stored = dict(WebhookEvent.objects.values_list("event_id", "api_version"))
    assert {stored[event["id"]] for event in acted} == set(junk)
    assert len(stored) == len(acted) + len(ignored) + 1
    assert series(samples, COUNTER) == {
        (("api_version", "other"),): len(junk),
        (("api_version", OLDER),): 1,
    }


@pytest.fixture
def monitor(settings: Any) -> Iterator[Client]:
    """A monitoring system presenting METRICS_TOKEN: it sees /health/'s whole report."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": TOKEN}
    health._shared = None
    yield Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    health._shared = None


def test_health_shows_the_last_24_hours_other_versions_and_is_never_degraded_by_them(
    client: Client, monitor: Client
) -> None:
    before = monitor.get("/health/").json()
    assert before["checks"]["api_versions"] == {
        "status": "ok",
        "api_version": stripe_events.API_VERSION,
        "other_versions_last_24h": 0,
        "other_versions": {},
        "critical": False,
        "ms": before["checks"]["api_versions"]["ms"],
    }
    for version in (stripe_events.API_VERSION, OLDER, OLDER, "2024-04-10.charon", None):
        send(client, version)
    yesterday = send(client, OLDER)
    WebhookEvent.objects.filter(event_id=yesterday["id"]).update(
        received_at=timezone.now() - timedelta(hours=25)
    )

    after = monitor.get("/health/").json()
    check = after["checks"]["api_versions"]
    assert (check["status"], check["other_versions_last_24h"]) == ("ok", 3)
    assert check["other_versions"] == {"2024-04-10.charon": 1, OLDER: 2}
    assert "api_versions" not in after["degraded"] + after["failing"]


def test_the_admin_lists_and_filters_events_by_version(client: Client) -> None:
    current = send(client, stripe_events.API_VERSION)
    older = send(client, OLDER)
    staff = admin_as(staff_user("op", groups=["operators"]))
    url = "/admin/webhooks/webhookevent/"

    listed = {row["event_id"]: row["api_version"] for row in rows(staff.get(url))}
    assert listed == {current["id"]: stripe_events.API_VERSION, older["id"]: OLDER}
    filtered = rows(staff.get(url, {"api_version": OLDER}))
    assert [row["event_id"] for row in filtered] == [older["id"]]
    page = staff.get(f"{url}{WebhookEvent.objects.get(event_id=older['id']).pk}/change/")
    assert OLDER in page.content.decode()
