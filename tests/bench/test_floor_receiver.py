"""The floor receiver (``bench/floor_receiver.py``), called as gunicorn calls it, against the
real PostgreSQL and Redis: its one statement still fits the application's tables. A NOT NULL
column the application adds breaks it, and then every floor request of a benchmark fails
(as the outbox's scheduled rows once did, unnoticed until the next benchmark)."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from psycopg.conninfo import make_conninfo

from asyncwork.contrib.backpressure import outbox_waiting
from asyncwork.models import Job
from bench import floor_receiver
from invoicing.models import Invoice
from stack import stripe_events
from tests.helpers import broker
from tests.helpers.stripe import SECRET, paid_event
from webhooks.models import WebhookEvent

pytestmark = [pytest.mark.django_db(transaction=True), broker.redis_only]


def _post(body: bytes) -> tuple[str, bytes]:
    environ = {
        "REQUEST_METHOD": "POST",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_STRIPE_SIGNATURE": stripe_events.signature_header(body, SECRET),
        "wsgi.input": io.BytesIO(body),
    }
    statuses: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]]) -> Any:
        statuses.append(status)

    answer = b"".join(floor_receiver.application(environ, start_response))
    return statuses[0], answer


def test_the_floor_receiver_stores_an_event_once_with_its_invoice_and_job_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = connection.settings_dict
    conninfo = make_conninfo(
        **{
            name: value
            for name, value in {
                "dbname": database["NAME"],
                "host": database["HOST"],
                "port": database["PORT"],
                "user": database["USER"],
                "password": database["PASSWORD"],
            }.items()
            if value
        }
    )
    monkeypatch.setenv("DATABASE_URL", conninfo)
    monkeypatch.setenv("STRIPE_WEBHOOK_SECRET", SECRET)
    monkeypatch.setattr(floor_receiver, "_process", {})
    body = stripe_events.encode(paid_event())
    try:
        assert _post(body) == ("200 OK", b'{"received": true, "duplicate": false}')
        assert _post(body) == ("200 OK", b'{"received": true, "duplicate": true}')
    finally:
        floor_receiver._process["database"].close()
    invoice = Invoice.objects.get()
    assert (WebhookEvent.objects.count(), invoice.status) == (1, "paid")
    assert list(Job.objects.values_list("task", "args")) == [
        (floor_receiver.FLOOR_TASK, [invoice.pk])
    ]
    # Written published: no backlog for the application's probes, backpressure or relay.
    assert not outbox_waiting(timezone.now()).exists()
