"""The Stripe API version of each event: stored on its row (a thin event has none), shown in the
admin, and an event of another version than ``STRIPE_API_VERSION`` taken all the same and
counted, in /metrics and in /health/'s details, which it never degrades. Against the real
PostgreSQL; the health checks run on connections of their own."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from asyncwork import health
from invoicing.models import Invoice
from tests.helpers.admin import admin_as, rows
from tests.helpers.factories import staff_user
from tests.helpers.metrics import delta, scrape
from tests.helpers.stripe import paid_event, post_event
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)

OLDER = "2024-06-20"
COUNTER = "invoicing_webhook_other_api_version_events_total"
TOKEN = "api-versions-test-token"


def send(client: Client, api_version: Any, **invoice: Any) -> dict[str, Any]:
    """A paid invoice's event rendered in ``api_version`` (None: Stripe's null), posted."""
    event = paid_event(**invoice)
    event["api_version"] = api_version
    response = post_event(client, stripe_testing.encode(event))
    assert response.status_code == 200, response.content
    return event


def test_the_default_is_the_version_the_handlers_and_their_events_are_written_for() -> None:
    assert settings.STRIPE_API_VERSION == stripe_testing.API_VERSION == "2025-09-30.clover"


def test_each_event_s_version_is_stored_and_another_version_is_still_applied(
    client: Client,
) -> None:
    current = send(client, stripe_testing.API_VERSION)
    older = send(client, OLDER, customer_email="older@example.com")
    unversioned = send(client, None)
    unreadable = send(client, {"not": "a version"})  # recorded as none, never refused
    thin = stripe_testing.thin_event("v1.billing.meter.no_meter_found", None)
    assert post_event(client, stripe_testing.encode(thin)).status_code == 200

    stored = dict(WebhookEvent.objects.values_list("event_id", "api_version"))
    assert stored == {
        current["id"]: stripe_testing.API_VERSION,
        older["id"]: OLDER,
        unversioned["id"]: "",
        unreadable["id"]: "",
        thin["id"]: "",
    }
    assert WebhookEvent.objects.get(event_id=older["id"]).state == "processed"
    assert Invoice.objects.filter(customer_email="older@example.com").exists()


def test_events_of_another_version_are_counted_once_by_version(client: Client) -> None:
    before = scrape(client)
    send(client, stripe_testing.API_VERSION)
    older = send(client, OLDER)
    assert post_event(client, stripe_testing.encode(older)).json()["duplicate"] is True
    send(client, "2024-04-10.charon")
    after = scrape(client)

    assert delta(before, after, COUNTER, api_version=OLDER) == 1
    assert delta(before, after, COUNTER, api_version="2024-04-10.charon") == 1
    assert delta(before, after, COUNTER, api_version=stripe_testing.API_VERSION) == 0


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
        "api_version": stripe_testing.API_VERSION,
        "other_versions_last_24h": 0,
        "other_versions": {},
        "critical": False,
        "ms": before["checks"]["api_versions"]["ms"],
    }
    for version in (stripe_testing.API_VERSION, OLDER, OLDER, "2024-04-10.charon", None):
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
    current = send(client, stripe_testing.API_VERSION)
    older = send(client, OLDER)
    staff = admin_as(staff_user("op", groups=["operators"]))
    url = "/admin/webhooks/webhookevent/"

    listed = {row["event_id"]: row["api_version"] for row in rows(staff.get(url))}
    assert listed == {current["id"]: stripe_testing.API_VERSION, older["id"]: OLDER}
    filtered = rows(staff.get(url, {"api_version": OLDER}))
    assert [row["event_id"] for row in filtered] == [older["id"]]
    page = staff.get(f"{url}{WebhookEvent.objects.get(event_id=older['id']).pk}/change/")
    assert OLDER in page.content.decode()
