"""``webhook_event_reprocess`` against the real PostgreSQL: applied once however many run it
at the same time, with the provider's time as on arrival."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection

from asyncwork.models import Job
from invoicing.models import Invoice
from stack import stripe_events
from tests.helpers.stripe import paid_event
from webhooks.models import WebhookEvent
from webhooks.stripe import Reprocessed, webhook_event_reprocess

pytestmark = pytest.mark.django_db(transaction=True)


def failed_row(event: dict[str, object], *, timestamp: int | None = None) -> WebhookEvent:
    body = stripe_events.encode(event)
    return WebhookEvent.objects.create(
        event_id=str(event["id"]),
        type=str(event["type"]),
        body=body.decode(),
        headers={
            "Stripe-Signature": stripe_events.signature_header(
                body, "whsec_test_primary", timestamp=timestamp
            )
        },
        state=WebhookEvent.State.FAILED,
        error="OperationalError('connection lost')",
    )


def test_concurrent_reprocesses_apply_a_failed_event_once() -> None:
    row = failed_row(paid_event())
    barrier = threading.Barrier(6)
    results: list[Reprocessed] = []

    def reprocess() -> None:
        try:
            barrier.wait()
            results.append(webhook_event_reprocess(event_ids=[row.event_id], actor="test"))
        finally:
            connection.close()

    threads = [threading.Thread(target=reprocess) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert [r.processed for r in results] == [[row.event_id]] * 6
    assert Invoice.objects.get().status == "paid"
    assert Job.objects.count() == 1  # one email asked for, not six
    row.refresh_from_db()
    assert (row.state, row.error) == ("processed", "")


def test_an_event_without_created_takes_the_signature_time_as_on_arrival() -> None:
    event = paid_event()
    del event["created"]
    row = failed_row(event, timestamp=1_700_000_000)
    assert webhook_event_reprocess(event_ids=[row.event_id], actor="test").processed == [
        row.event_id
    ]
    assert Invoice.objects.get().provider_updated_at == datetime.fromtimestamp(
        1_700_000_000, tz=UTC
    )


def test_a_stale_event_reprocessed_never_moves_the_invoice_back() -> None:
    newer = paid_event("in_order", created=2_000_000_000, amount=5000)
    older = paid_event("in_order", created=1_900_000_000, amount=100, status="open")
    rows = [failed_row(newer), failed_row(older)]
    result = webhook_event_reprocess(event_ids=[r.event_id for r in reversed(rows)], actor="test")
    assert sorted(result.processed) == sorted(r.event_id for r in rows)
    invoice = Invoice.objects.get()
    assert (invoice.status, invoice.amount_paid) == ("paid", 5000)


def test_unknown_ids_are_reported_missing() -> None:
    result = webhook_event_reprocess(event_ids=["evt_gone"], actor="test")
    assert result == Reprocessed(processed=[], ignored=[], failed=[], missing=["evt_gone"])


def test_reprocessing_an_event_of_the_other_mode_leaves_it_ignored(settings: Any) -> None:
    # A live event stored as failed (before STRIPE_LIVEMODE was set to test, say): the
    # admin's Reprocess must not apply what the endpoint would now ignore.
    settings.STRIPE_LIVEMODE = "test"
    event = paid_event()
    event["livemode"] = True
    row = failed_row(event)

    result = webhook_event_reprocess(event_ids=[row.event_id], actor="admin:op")

    assert result.ignored == [row.event_id]
    row.refresh_from_db()
    assert (row.state, row.error) == ("ignored", "live-mode event; STRIPE_LIVEMODE is test")
    assert not Invoice.objects.exists()
    assert not Job.objects.exists()
