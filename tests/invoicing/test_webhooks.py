"""The payment events through ``webhooks.stripe.webhook_event_record`` against the real
PostgreSQL, as a request records them: event, invoice and the email's job (``Job``, enqueued by
``send_invoice_email.enqueue``) in one transaction, the publish once it commits; duplicates and
concurrent events of one invoice leave one job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from django.db import connection, transaction

from asyncwork.models import Job
from invoicing.models import Invoice
from invoicing.services import InvoiceData, invoice_record_payment
from invoicing.tasks import send_invoice_email
from stack import stripe_events
from tests.helpers.stripe import paid_event
from webhooks.models import WebhookEvent
from webhooks.stripe import Event, Recorded, event_parse, webhook_event_record

pytestmark = pytest.mark.django_db(transaction=True)

NOW = int(time.time())


def _event(
    invoice_id: str, *, created: int, event_type: str = "invoice.paid", **invoice: Any
) -> tuple[Event, str]:
    body = stripe_events.encode(
        paid_event(invoice_id, event_type=event_type, created=created, **invoice)
    )
    return event_parse(payload=body, signed_at=NOW), body.decode()


def _record(event: Event, body: str) -> Recorded:
    return webhook_event_record(event=event, body=body, headers={"User-Agent": "Stripe/1.0"})


def _jobs(invoice: Invoice) -> int:
    return Job.objects.filter(args=[invoice.pk]).count()


def test_a_new_paid_event_writes_event_invoice_and_job_in_one_transaction() -> None:
    """The three INSERTs run in one transaction (one transaction id); the job is published
    once it committed."""
    writes: list[tuple[str, object]] = []

    def spy(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        result = execute(sql, *args)
        if sql.startswith("INSERT"):
            assert connection.connection is not None
            xid = connection.connection.execute("SELECT pg_current_xact_id_if_assigned()")
            writes.append((sql.split()[2].strip('"'), xid.fetchone()))
        return result

    event, body = _event("in_one_transaction", created=NOW)
    connection.ensure_connection()
    with connection.execute_wrapper(spy):
        recorded = _record(event, body)

    assert recorded.duplicate is False
    assert [table for table, _ in writes] == [
        "webhooks_webhookevent",
        "invoicing_invoice",
        "asyncwork_job",
    ]
    xids = {xid for _, xid in writes}
    assert len(xids) == 1
    assert xids != {(None,)}
    invoice = Invoice.objects.get(provider_invoice_id="in_one_transaction")
    row = Job.objects.get()
    assert (row.task, row.args, row.kwargs, row.queue, row.status) == (
        send_invoice_email.module_path,
        [invoice.pk],
        {},
        "email",
        "READY",
    )
    assert row.published_at is not None
    stored = WebhookEvent.objects.get()
    assert (stored.event_id, stored.state, stored.body, stored.headers) == (
        event.id,
        WebhookEvent.State.PROCESSED,
        body,
        {"User-Agent": "Stripe/1.0"},
    )


def test_a_duplicate_changes_nothing() -> None:
    event, body = _event("in_dup", created=NOW)
    assert _record(event, body).duplicate is False
    invoice = Invoice.objects.values().get()
    assert _record(event, body).duplicate is True
    assert Invoice.objects.values().get() == invoice
    assert (WebhookEvent.objects.count(), Job.objects.count()) == (1, 1)


def test_concurrent_duplicates_and_events_of_one_invoice_write_one_job() -> None:
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
    assert _jobs(invoice) == 1


@pytest.mark.parametrize(("first", "job_by"), [("paid", "first"), ("open", "second")])
def test_an_event_waiting_on_another_events_new_invoice_writes_one_job(
    first: str, job_by: str
) -> None:
    """The first event's transaction holds the new invoice uncommitted while the second event
    is recorded: the second waits on the invoice's row, then reads it as committed, under its
    lock: one job, written by whichever event made the invoice paid."""
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
    two.start()
    two.join(1)
    waited = two.is_alive()  # on the first event's row
    release.set()
    one.join(20)
    two.join(20)

    assert errors == []
    assert waited
    assert [r.duplicate for r in results] == [False]
    invoice = Invoice.objects.get()
    assert (invoice.status, invoice.customer_email) == ("paid", "b@example.com")
    assert WebhookEvent.objects.get().event_id == second_event.id
    rows = list(Job.objects.filter(args=[invoice.pk]))
    assert len(rows) == 1
    made_paid_at: datetime = rows[0].created_at
    # The first event's row predates the second's wait; the second's comes after it.
    assert (made_paid_at < invoice.updated_at) == (job_by == "first")
