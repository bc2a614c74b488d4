"""The tutorial arm (``bench/tutorial.py``) against the real PostgreSQL, broker and SMTP server:
it does what the benchmarks count on. Its webhook, through the benchmarks' URLconf, stores a new
event once with its invoice and publishes the email task on commit; a redelivery publishes
nothing; a bad signature stores nothing. Its task sends one email, which the benchmarks' check
attributes to its invoice by the recipient."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from asyncwork.broker import DEFAULT
from bench import tutorial
from bench.fullstack import TUTORIAL_DOMAIN, emails_check
from bench.run import TUTORIAL_PATH
from invoicing.models import Invoice
from stack import stripe_events
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.stripe import SECRET, paid_event
from webhooks.models import WebhookEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("bench.urls")]


def _post(client: Client, body: bytes, *, secret: str = SECRET) -> Any:
    return client.post(
        TUTORIAL_PATH,
        data=body,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=stripe_events.signature_header(body, secret),
    )


def test_the_tutorial_webhook_stores_a_new_event_once_and_publishes_its_email_on_commit(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRIPE_WEBHOOK_SECRET", SECRET)
    body = stripe_events.encode(paid_event())

    assert _post(client, body, secret="whsec_someone_else").status_code == 400
    assert not WebhookEvent.objects.exists()
    first, again = _post(client, body), _post(client, body)

    assert (first.status_code, first.json()) == (200, {"received": True, "duplicate": False})
    assert (again.status_code, again.json()) == (200, {"received": True, "duplicate": True})
    invoice = Invoice.objects.get()
    assert (WebhookEvent.objects.count(), invoice.status) == (1, Invoice.Status.PAID)
    published = [
        (message["headers"]["task"], message["headers"]["argsrepr"])
        for message in broker.queue_messages(DEFAULT)
    ]
    assert published == [(tutorial.TUTORIAL_TASK, f"({invoice.pk},)")]


def test_the_tutorial_task_sends_one_email_named_by_its_recipient(smtp: SmtpServer) -> None:
    provider_id = stripe_events.new_id("in")
    invoice = paid_invoice(provider_id, customer_email=f"{provider_id}@{TUTORIAL_DOMAIN}")

    tutorial.send_invoice_email(invoice.pk)

    assert smtp.handler.wait_for(1, timeout=5)
    (email,) = smtp.handler.received()
    assert f"Subject: Your invoice {invoice.number} is paid".encode() in email.content
    assert b"Content-Type: text/html" in email.content
    assert emails_check(smtp, [provider_id])["ok"]
