"""Thin events (``v2.core.event``: ``created`` an ISO 8601 string, a ``related_object``, no
``data``), shaped as Stripe's docs show them, through POST /webhooks/stripe/ against the real
PostgreSQL: stored once under their id, ignored with a 200 unless a handler is declared for
their type; a declared handler gets stripe-python's ``EventNotification`` of it (of its type's
class, or ``UnknownEventNotification``), which calls nothing in the request, and a task reads it
again to fetch its object from the stand-in of the Stripe API. One stripe-python cannot read is
a 400 for a handled type only; a type nothing handles is stored whatever its shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import stripe
from django.test import Client
from stripe.events import (
    UnknownEventNotification,
    V1BillingMeterErrorReportTriggeredEventNotification,
)

from stack import stripe_events
from stack.stripe_api import StripeApi
from tests.helpers.stripe import post_event
from webhooks import stripe as webhook_events
from webhooks.models import WebhookEvent
from webhooks.stripe import Event, event_notification, event_parse
from webhooks.stripe_api import stripe_client

pytestmark = pytest.mark.django_db

TYPE = "v1.billing.meter.error_report_triggered"
UNKNOWN_TYPE = "v2.core.example.not_known_to_stripe_python"
METER = {
    "id": "mtr_test_61R9IeFvnzT0zbVmE41IeFvnSHMkAKgy",
    "type": "billing.meter",
    "url": "/v1/billing/meters/mtr_test_61R9IeFvnzT0zbVmE41IeFvnSHMkAKgy",
}


def thin(created: Any = "2024-09-26T17:46:22.134Z", **fields: Any) -> dict[str, Any]:
    return {**stripe_events.thin_event(TYPE, METER, created=created), **fields}


def test_a_thin_event_is_stored_ignored_and_a_redelivery_is_a_duplicate(client: Client) -> None:
    event = thin()
    body = stripe_events.encode(event)
    response = post_event(client, body)
    assert response.status_code == 200
    assert response.json() == {
        "received": True,
        "event_id": event["id"],
        "type": TYPE,
        "duplicate": False,
        "handled": False,
    }
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
    body = stripe_events.encode(thin(created))
    assert event_parse(payload=body, signed_at=int(time.time())).created == expected
    assert post_event(client, body).status_code == 200


def test_without_created_the_signature_time_is_the_event_time() -> None:
    event = thin()
    del event["created"]
    signed_at = int(time.time())
    parsed = event_parse(payload=stripe_events.encode(event), signed_at=signed_at)
    assert parsed.created == datetime.fromtimestamp(signed_at, UTC)


@pytest.mark.parametrize(
    "created", ["yesterday", "2024-13-45T00:00:00Z", "", 1727372782, ["2024-09-26"]]
)
def test_a_created_that_cannot_be_read_is_a_clear_400(client: Client, created: Any) -> None:
    response = post_event(client, stripe_events.encode(thin(created)))
    assert (response.status_code, response.json()) == (
        400,
        {"error": "created is not an ISO 8601 time"},
    )
    assert not WebhookEvent.objects.exists()


def test_a_snapshot_event_keeps_its_epoch_created(client: Client) -> None:
    event = stripe_events.event("customer.created", stripe_events.customer_object())
    event["created"] = "2024-09-26T17:46:22Z"
    response = post_event(client, stripe_events.encode(event))
    assert (response.status_code, response.json()) == (
        400,
        {"error": "created is not a non-negative integer"},
    )


def test_a_thin_event_of_another_account_is_out_of_scope(client: Client, settings: Any) -> None:
    settings.STRIPE_ACCOUNT = "acct_mine"
    ours, theirs = thin(context="acct_mine"), thin(context="acct_theirs")
    assert post_event(client, stripe_events.encode(ours)).status_code == 200
    assert post_event(client, stripe_events.encode(theirs)).status_code == 200
    stored = dict(WebhookEvent.objects.values_list("event_id", "error"))
    assert stored == {
        ours["id"]: "",
        theirs["id"]: "event for account 'acct_theirs'; STRIPE_ACCOUNT is acct_mine",
    }


@pytest.fixture
def handled() -> Iterator[list[tuple[Any, Event]]]:
    """Handlers declared for the test (the meter's type and one stripe-python does not know),
    taken away after it; what each ``parse`` was given, with the event applied."""
    seen: list[tuple[Any, Event]] = []

    def parse(notification: Any) -> Any:
        with pytest.raises(stripe.APIConnectionError, match="no call to the Stripe API while"):
            notification.fetch_event()  # nothing in the request calls Stripe
        return notification

    @webhook_events.webhook_handler(TYPE, UNKNOWN_TYPE, parse=parse)
    def apply(notification: Any, event: Event) -> None:
        seen.append((notification, event))

    try:
        yield seen
    finally:
        webhook_events._handlers.pop(TYPE)
        webhook_events._handlers.pop(UNKNOWN_TYPE)


def test_a_handler_gets_stripe_pythons_notification_which_calls_nothing(
    client: Client, stripe_api: StripeApi, handled: list[tuple[Any, Event]]
) -> None:
    event = thin(context="acct_1Nv0FGQ9RKHgCVdK")
    unknown = {**thin(), "type": UNKNOWN_TYPE}
    for body in (event, unknown):
        assert post_event(client, stripe_events.encode(body)).status_code == 200

    [(notification, applied), (other, _)] = handled
    assert isinstance(notification, V1BillingMeterErrorReportTriggeredEventNotification)
    assert (notification.id, notification.type) == (event["id"], TYPE)
    assert (notification.related_object.id, notification.related_object.url) == (
        METER["id"],
        METER["url"],
    )
    assert str(notification.context) == "acct_1Nv0FGQ9RKHgCVdK"
    assert type(other) is UnknownEventNotification
    assert other.related_object is not None
    assert other.related_object.url == METER["url"]
    assert (applied.id, applied.type, applied.api_version) == (event["id"], TYPE, "")
    assert applied.created == datetime(2024, 9, 26, 17, 46, 22, 134000, UTC)
    assert set(WebhookEvent.objects.values_list("state", flat=True)) == {"processed"}
    assert stripe_api.requests == []

    # A task reads the stored event again with the application's client, and fetches.
    stripe_api.meters[METER["id"]] = {"id": METER["id"], "object": "billing.meter"}
    stored = WebhookEvent.objects.get(event_id=event["id"])
    client_ = stripe_client()
    assert client_ is not None
    again = event_notification(json.loads(stored.body), client=client_)
    assert isinstance(again, V1BillingMeterErrorReportTriggeredEventNotification)
    meter = again.fetch_related_object()
    assert (meter.id, meter.object) == (METER["id"], "billing.meter")
    assert stripe_api.requests == [METER["url"]]
    assert stripe_api.contexts == ["acct_1Nv0FGQ9RKHgCVdK"]


# Signed thin events stripe-python's EventNotification cannot read (stripe 16.1: KeyError,
# TypeError or AttributeError), each with the reason our 400 gives it.
UNREADABLE = [
    ({"related_object": None}, "TypeError 'NoneType' object is not subscriptable"),
    ({"related_object": {"id": METER["id"], "type": "billing.meter"}}, "KeyError 'url'"),
    ({"reason": {"type": "request"}}, "KeyError 'request'"),
    ({"context": 42}, "AttributeError 'int' object has no attribute 'split'"),
]


@pytest.mark.parametrize(("fields", "words"), UNREADABLE)
def test_a_thin_event_stripe_python_cannot_read_is_a_400_only_for_a_handled_type(
    client: Client, handled: list[tuple[Any, Event]], fields: dict[str, Any], words: str
) -> None:
    refused = post_event(client, stripe_events.encode(thin(**fields)))
    assert (refused.status_code, refused.json()) == (
        400,
        {"error": f"stripe-python cannot read this thin event: {words}"},
    )
    assert not WebhookEvent.objects.exists()

    # A type nothing handles is stored, whatever stripe-python would make of it.
    taken = thin(**fields, type="v1.billing.meter.something_else")
    answer = post_event(client, stripe_events.encode(taken))
    assert (answer.status_code, answer.json()["duplicate"]) == (200, False)
    assert WebhookEvent.objects.get().state == WebhookEvent.State.IGNORED
    assert handled == []


def test_livemode_is_read_as_stripe_documents_not_as_stripe_python_does(
    client: Client, settings: Any
) -> None:
    # EventNotification reads bool("false"): live. Only an explicit true is live here.
    body = thin(livemode="false")
    assert event_notification(body).livemode is True
    settings.STRIPE_LIVEMODE = "live"
    assert post_event(client, stripe_events.encode(body)).status_code == 200
    assert WebhookEvent.objects.get().error == "test-mode event; STRIPE_LIVEMODE is live"


def test_the_stripe_cli_thin_types_are_sent_thin(client: Client) -> None:
    for event_type, related in (
        (TYPE, "/v1/billing/meters/mtr_"),
        ("v1.billing.meter.no_meter_found", None),  # no meter was found: nothing to refer to
    ):
        event = stripe_events.trigger_event(event_type)
        assert (event["object"], "data" in event) == ("v2.core.event", False)
        url = str((event["related_object"] or {}).get("url"))
        assert url.startswith(related) if related else url == "None"
        created = datetime.fromisoformat(event["created"])
        assert abs(created - datetime.now(UTC)) < timedelta(minutes=1)
        assert post_event(client, stripe_events.encode(event)).status_code == 200
        event_notification(event)  # stripe-python reads it
    assert set(WebhookEvent.objects.values_list("state", flat=True)) == {"ignored"}
