"""Dispatch by registry (``webhooks.stripe``): an event type is acted on when an app registered
a handler for it, and only then; the handler's effect commits with the event row or not at
all, and a handled type is essential under backpressure."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from asyncwork.models import Job
from stack import stripe_events
from tests.helpers.stripe import post_event
from webhooks import stripe as webhook_events
from webhooks.models import WebhookEvent
from webhooks.stripe import Event, WebhookRejected

pytestmark = pytest.mark.django_db

TYPE = "customer.created"


@pytest.fixture
def applied() -> Iterator[list[tuple[str, Any]]]:
    """A handler for customer.created for the test, taken away after it."""
    seen: list[tuple[str, Any]] = []

    def parse(obj: Any) -> str:
        if not isinstance(obj, dict) or not obj.get("email"):
            raise WebhookRejected("data.object.email is missing")
        return str(obj["email"])

    @webhook_events.webhook_handler(TYPE, parse=parse)
    def apply(email: str, event: Event) -> None:
        assert connection.in_atomic_block  # inside the transaction that stores the event
        seen.append((event.id, email))
        if email == "fails@example.com":
            raise RuntimeError("the handler failed")

    try:
        yield seen
    finally:
        webhook_events._handlers.pop(TYPE)


def customer_event(email: str) -> dict[str, Any]:
    return stripe_events.event(TYPE, stripe_events.customer_object(customer_email=email))


def test_a_registered_type_is_parsed_applied_and_stored_processed(
    client: Client, applied: list[tuple[str, Any]]
) -> None:
    event = customer_event("new@example.com")
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    assert applied == [(event["id"], "new@example.com")]
    assert WebhookEvent.objects.get().state == WebhookEvent.State.PROCESSED
    # A duplicate delivery is stored once and applied once.
    assert post_event(client, stripe_events.encode(event)).json()["duplicate"] is True
    assert len(applied) == 1


def test_the_handler_refuses_what_it_cannot_read_before_anything_is_stored(
    client: Client, applied: list[tuple[str, Any]]
) -> None:
    response = post_event(client, stripe_events.encode(customer_event("")))
    assert (response.status_code, response.json()) == (
        400,
        {"error": "data.object.email is missing"},
    )
    assert not WebhookEvent.objects.exists()
    assert applied == []


def test_a_failing_handler_leaves_no_event_row(
    client: Client, applied: list[tuple[str, Any]]
) -> None:
    client.raise_request_exception = False
    response = post_event(client, stripe_events.encode(customer_event("fails@example.com")))
    assert response.status_code == 500
    assert not WebhookEvent.objects.exists()  # the provider will deliver it again


def test_without_a_handler_the_type_is_ignored_and_not_essential(
    client: Client, settings: Any
) -> None:
    assert webhook_events.handler_for(TYPE) is None
    assert webhook_events.handler_for("invoice.paid") is not None  # registered by invoicing
    event = customer_event("nobody@example.com")
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    assert WebhookEvent.objects.get().state == WebhookEvent.State.IGNORED
    assert not Job.objects.exists()


def test_a_handled_type_is_essential_under_backpressure(
    client: Client, settings: Any, applied: list[tuple[str, Any]]
) -> None:
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_CHECK_SECONDS": 0,
        "BACKPRESSURE_SOFT_MARK": 1,
        "BACKPRESSURE_HARD_MARK": 1000,
    }
    Job.objects.create(task="some.task", args=[1], queue=f"q-{uuid.uuid4().hex[:8]}")
    handled = customer_event("kept@example.com")
    assert post_event(client, stripe_events.encode(handled)).status_code == 200
    webhook_events._handlers.pop(TYPE)
    try:
        unhandled = customer_event("shed@example.com")
        assert post_event(client, stripe_events.encode(unhandled)).status_code == 503
    finally:
        webhook_events.webhook_handler(TYPE, parse=str)(lambda data, event: None)
    assert list(WebhookEvent.objects.values_list("event_id", flat=True)) == [handled["id"]]
