"""The payment events' one statement (``invoicing.webhooks.INVOICE_PAYMENT_STATEMENT``, run by
``webhooks.services.webhook_event_record``) against the real PostgreSQL, in autocommit as a
request runs it: one round trip; the same invoice and outbox rows as ``invoice_record_payment``;
what its snapshot cannot settle goes through ``invoice_record_payment`` instead."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from django.db import connection, transaction

from asyncwork.models import OutboxMessage
from invoicing.models import Invoice
from invoicing.services import InvoiceData, invoice_record_payment
from tests.helpers.stripe import paid_event
from webhooks import testing as stripe_testing
from webhooks.events import Event
from webhooks.models import WebhookEvent
from webhooks.services import Recorded, webhook_event_record
from webhooks.stripe import event_parse

pytestmark = pytest.mark.django_db(transaction=True)

NOW = int(time.time())


def _event(
    invoice_id: str, *, created: int, event_type: str = "invoice.paid", **invoice: Any
) -> tuple[Event, str]:
    body = stripe_testing.encode(
        paid_event(invoice_id, event_type=event_type, created=created, **invoice)
    )
    return event_parse(payload=body, signed_at=NOW), body.decode()


def _record(event: Event, body: str) -> Recorded:
    return webhook_event_record(event=event, body=body, headers={"User-Agent": "Stripe/1.0"})


def _outbox_rows(invoice: Invoice) -> int:
    return OutboxMessage.objects.filter(args=[invoice.pk]).count()


def test_a_new_paid_event_is_one_statement_in_autocommit_then_the_publish_mark() -> None:
    statements: list[tuple[str, bool]] = []

    def spy(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        statements.append((sql, connection.in_atomic_block))
        return execute(sql, *args)

    event, body = _event("in_one_trip", created=NOW)
    connection.ensure_connection()
    with connection.execute_wrapper(spy):
        recorded = _record(event, body)

    assert recorded.duplicate is False
    # The event, the invoice and the outbox row in one statement, outside any transaction
    # block (no BEGIN, no COMMIT), then the on-commit publish's mark.
    assert [sql.split()[0] for sql, _ in statements] == ["WITH", "UPDATE"]
    assert [atomic for _, atomic in statements] == [False, False]
    invoice = Invoice.objects.get(provider_invoice_id="in_one_trip")
    row = OutboxMessage.objects.get()
    assert (row.task, row.args, row.kwargs, row.queue) == (
        "invoicing.send_invoice_email",
        [invoice.pk],
        {},
        "email",
    )
    assert row.published_at is not None
    stored = WebhookEvent.objects.get()
    assert (stored.event_id, stored.state, stored.body, stored.headers) == (
        event.id,
        WebhookEvent.State.PROCESSED,
        body,
        {"User-Agent": "Stripe/1.0"},
    )
    # Prepared once on the connection, then run by name.
    assert _record(*_event("in_one_trip_2", created=NOW)).duplicate is False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH event AS%%'"
        )
        assert cursor.fetchone() == (1,)


# Sequences of (seconds after NOW, invoice fields) for one invoice, each delivered as a new event.
SEQUENCES: dict[str, list[tuple[int, dict[str, Any]]]] = {
    "paid": [(0, {"status": "paid", "paid_at": NOW})],
    "open, then paid": [(0, {"status": "open"}), (10, {"status": "paid", "paid_at": NOW + 10})],
    "paid, then a later open": [
        (0, {"status": "paid", "paid_at": NOW}),
        (10, {"status": "open", "customer_email": "later@example.com"}),
    ],
    "paid, then an older one": [
        (10, {"status": "paid", "paid_at": NOW + 10}),
        (0, {"status": "paid", "paid_at": NOW, "customer_email": "older@example.com"}),
    ],
    "open, open": [(0, {"status": "open"}), (10, {"status": "open", "amount": 5})],
    "paid without paid_at, then paid with": [
        (0, {"status": "paid"}),
        (10, {"status": "paid", "paid_at": NOW + 10, "number": "INV-2"}),
    ],
    "same time twice": [(0, {"status": "open"}), (0, {"status": "paid", "paid_at": NOW})],
}
COMPARED = [
    f.attname
    for f in Invoice._meta.concrete_fields
    if f.attname not in {"id", "provider_invoice_id", "created_at", "updated_at"}
]


@pytest.mark.parametrize("name", SEQUENCES)
def test_the_statement_leaves_what_invoice_record_payment_leaves(name: str) -> None:
    for i, (offset, fields) in enumerate(SEQUENCES[name]):
        event_type = ("invoice.paid", "invoice.payment_succeeded")[i % 2]
        event, body = _event("in_stmt", created=NOW + offset, event_type=event_type, **fields)
        assert _record(event, body).duplicate is False
        assert isinstance(event.data, InvoiceData)
        with transaction.atomic():
            invoice_record_payment(
                data=dataclasses.replace(event.data, provider_invoice_id="in_ref"),
                provider_time=event.created,
            )
    by_statement = Invoice.objects.get(provider_invoice_id="in_stmt")
    by_python = Invoice.objects.get(provider_invoice_id="in_ref")
    assert [getattr(by_statement, f) for f in COMPARED] == [getattr(by_python, f) for f in COMPARED]
    assert _outbox_rows(by_statement) == _outbox_rows(by_python) <= 1
    assert WebhookEvent.objects.count() == len(SEQUENCES[name])


def test_a_duplicate_changes_nothing() -> None:
    event, body = _event("in_dup", created=NOW)
    assert _record(event, body).duplicate is False
    invoice = Invoice.objects.values().get()
    assert _record(event, body).duplicate is True
    assert Invoice.objects.values().get() == invoice
    assert (WebhookEvent.objects.count(), OutboxMessage.objects.count()) == (1, 1)


def test_concurrent_duplicates_and_events_of_one_invoice_write_one_outbox_row() -> None:
    """Twelve threads: three deliveries each of four events (two types, two times) of one new
    invoice, at once."""
    events = [
        _event("in_many", created=NOW + offset, event_type=event_type)
        for event_type in ("invoice.paid", "invoice.payment_succeeded")
        for offset in (0, 5)
    ]
    barrier = threading.Barrier(12)
    outcomes: list[bool] = []
    errors: list[BaseException] = []

    def deliver(event: Event, body: str) -> None:
        try:
            barrier.wait()
            outcomes.append(_record(event, body).duplicate)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver, args=pair) for pair in events * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert sorted(outcomes) == [False] * 4 + [True] * 8
    invoice = Invoice.objects.get()
    assert invoice.status == "paid"
    assert invoice.provider_updated_at.timestamp() == NOW + 5
    assert WebhookEvent.objects.count() == 4
    assert _outbox_rows(invoice) == 1


@pytest.mark.parametrize(("first", "outbox_by"), [("paid", "first"), ("open", "second")])
def test_an_invoice_committed_after_the_statement_began_goes_through_the_transaction(
    first: str, outbox_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first event's transaction holds the new invoice uncommitted while the second's
    statement runs: the statement cannot see whether it was paid before, so it undoes itself
    (nothing of it stays, not even its event row) and the event is recorded in a transaction,
    which knows: one outbox row, written by whichever event made the invoice paid."""
    inserted, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    second_event, second_body = _event(
        "in_late", created=NOW + 5, status="paid", paid_at=NOW, customer_email="b@example.com"
    )
    results: list[Recorded] = []

    def first_event() -> None:
        try:
            event, _ = _event("in_late", created=NOW, status=first, paid_at=NOW)
            assert isinstance(event.data, InvoiceData)
            with transaction.atomic():
                invoice_record_payment(data=event.data, provider_time=event.created)
                inserted.set()
                release.wait(20)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def second() -> None:
        try:
            results.append(_record(second_event, second_body))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    one = threading.Thread(target=first_event)
    one.start()
    assert inserted.wait(10)
    two = threading.Thread(target=second)
    with caplog.at_level(logging.INFO, logger="webhooks.services"):
        two.start()
        two.join(1)
        waited = two.is_alive()  # on the first event's row
        release.set()
        one.join(20)
        two.join(20)

    assert errors == []
    assert waited
    assert [r.duplicate for r in results] == [False]
    assert "webhook event recorded in a transaction instead" in caplog.messages
    invoice = Invoice.objects.get()
    assert (invoice.status, invoice.customer_email) == ("paid", "b@example.com")
    assert WebhookEvent.objects.get().event_id == second_event.id
    rows = list(OutboxMessage.objects.filter(args=[invoice.pk]))
    assert len(rows) == 1
    made_paid_at: datetime = rows[0].created_at
    # The first event's row predates the second's statement; the second's comes after it.
    assert (made_paid_at < invoice.updated_at) == (outbox_by == "first")
