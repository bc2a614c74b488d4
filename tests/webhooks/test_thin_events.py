"""Thin events (``v2.core.event``: ``created`` an ISO 8601 string, a ``related_object``, no
``data``), shaped as Stripe's docs show them, through POST /webhooks/stripe/ against the real
PostgreSQL: stored once under their id, ignored with a 200 unless a handler is declared for
their type, and a declared handler gets the event itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client

from tests.helpers.stripe import post_event
from webhooks import events
from webhooks import testing as stripe_testing
from webhooks.events import Event, WebhookRejected
from webhooks.models import WebhookEvent
from webhooks.stripe import event_parse

pytestmark = pytest.mark.django_db

TYPE = "v1.billing.meter.no_meter_found"
METER = {
    "id": "mtr_test_61R9IeFvnzT0zbVmE41IeFvnSHMkAKgy",
    "type": "billing.meter",
    "url": "/v1/billing/meters/mtr_test_61R9IeFvnzT0zbVmE41IeFvnSHMkAKgy",
}


def thin(created: Any = "2024-09-26T17:46:22.134Z", **fields: Any) -> dict[str, Any]:
    return {**stripe_testing.thin_event(TYPE, METER, created=created), **fields}


def test_a_thin_event_is_stored_ignored_and_a_redelivery_is_a_duplicate(client: Client) -> None:
    event = thin()
    body = stripe_testing.encode(event)
    response = post_event(client, body)
    assert response.status_code == 200
    assert response.json() == {"received": True, "event_id": event["id"], "duplicate": False}
    stored = WebhookEvent.objects.get()
    assert (stored.type, stored.state, stored.api_version) == (TYPE, "ignored", "")
    assert stored.body == body.decode()

    again = post_event(client, body)
    assert (again.status_code, again.json()["duplicate"]) == (200, True)
    assert WebhookEvent.objects.count() == 1


@pytest.mark.parametrize(
    ("created", "expected"),
    [
        ("2024-09-26T17:46:22.134Z", datetime(2024, 9, 26, 17, 46, 22, 134000, UTC)),
        ("2024-09-26T17:46:22Z", datetime(2024, 9, 26, 17, 46, 22, tzinfo=UTC)),
        ("2024-09-26T19:46:22.134+02:00", datetime(2024, 9, 26, 17, 46, 22, 134000, UTC)),
        ("2024-09-26T12:46:22-05:00", datetime(2024, 9, 26, 17, 46, 22, tzinfo=UTC)),
        ("2024-09-26T17:46:22.134567891Z", datetime(2024, 9, 26, 17, 46, 22, 134567, UTC)),
        ("2024-09-26T17:46:22", datetime(2024, 9, 26, 17, 46, 22, tzinfo=UTC)),  # UTC, as Stripe's
    ],
)
def test_created_is_read_as_an_iso_8601_time_in_utc(
    client: Client, created: str, expected: datetime
) -> None:
    body = stripe_testing.encode(thin(created))
    assert event_parse(payload=body, signed_at=int(time.time())).created == expected
    assert post_event(client, body).status_code == 200


def test_without_created_the_signature_time_is_the_event_time() -> None:
    event = thin()
    del event["created"]
    signed_at = int(time.time())
    parsed = event_parse(payload=stripe_testing.encode(event), signed_at=signed_at)
    assert parsed.created == datetime.fromtimestamp(signed_at, UTC)


@pytest.mark.parametrize(
    "created", ["yesterday", "2024-13-45T00:00:00Z", "", 1727372782, ["2024-09-26"]]
)
def test_a_created_that_cannot_be_read_is_a_clear_400(client: Client, created: Any) -> None:
    response = post_event(client, stripe_testing.encode(thin(created)))
    assert (response.status_code, response.json()) == (
        400,
        {"error": "created is not an ISO 8601 time"},
    )
    assert not WebhookEvent.objects.exists()


def test_a_snapshot_event_keeps_its_epoch_created(client: Client) -> None:
    event = stripe_testing.event("customer.created", stripe_testing.customer_object())
    event["created"] = "2024-09-26T17:46:22Z"
    response = post_event(client, stripe_testing.encode(event))
    assert (response.status_code, response.json()) == (
        400,
        {"error": "created is not a non-negative integer"},
    )


def test_a_thin_event_of_another_account_is_out_of_scope(client: Client, settings: Any) -> None:
    settings.STRIPE_ACCOUNT = "acct_mine"
    ours, theirs = thin(context="acct_mine"), thin(context="acct_theirs")
    assert post_event(client, stripe_testing.encode(ours)).status_code == 200
    assert post_event(client, stripe_testing.encode(theirs)).status_code == 200
    stored = dict(WebhookEvent.objects.values_list("event_id", "error"))
    assert stored == {
        ours["id"]: "",
        theirs["id"]: "event for account 'acct_theirs'; STRIPE_ACCOUNT is acct_mine",
    }


@pytest.fixture
def handled() -> Iterator[list[tuple[Any, Event]]]:
    """A handler declared for the thin type for the test, taken away after it."""
    seen: list[tuple[Any, Event]] = []

    def parse(event: Any) -> tuple[str, str]:
        related = event.get("related_object")
        if not isinstance(related, dict) or not isinstance(related.get("url"), str):
            raise WebhookRejected("related_object.url is missing")
        return related["url"], str(event.get("context") or "")

    @events.webhook_handler(TYPE, parse=parse)
    def apply(fetch: tuple[str, str], event: Event) -> None:
        seen.append((fetch, event))

    try:
        yield seen
    finally:
        events._handlers.pop(TYPE)


def test_a_declared_handler_gets_the_thin_event_itself(
    client: Client, handled: list[tuple[Any, Event]]
) -> None:
    event = thin(context="acct_1Nv0FGQ9RKHgCVdK")
    assert post_event(client, stripe_testing.encode(event)).status_code == 200
    [(fetch, applied)] = handled
    assert fetch == (METER["url"], "acct_1Nv0FGQ9RKHgCVdK")
    assert (applied.id, applied.type, applied.api_version) == (event["id"], TYPE, "")
    assert applied.created == datetime(2024, 9, 26, 17, 46, 22, 134000, UTC)
    assert WebhookEvent.objects.get().state == WebhookEvent.State.PROCESSED


def test_the_stripe_cli_thin_types_are_sent_thin(client: Client) -> None:
    for event_type in ("v1.billing.meter.error_report_triggered", TYPE):
        event = stripe_testing.trigger_event(event_type)
        assert (event["object"], "data" in event) == ("v2.core.event", False)
        assert event["related_object"]["url"].startswith("/v1/billing/meters/mtr_")
        created = datetime.fromisoformat(event["created"])
        assert abs(created - datetime.now(UTC)) < timedelta(minutes=1)
        assert post_event(client, stripe_testing.encode(event)).status_code == 200
    assert set(WebhookEvent.objects.values_list("state", flat=True)) == {"ignored"}
