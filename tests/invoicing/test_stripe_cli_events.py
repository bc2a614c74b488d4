"""The events ``stripe trigger invoice.paid`` produces (``tests.helpers.stripe
.cli_invoice_paid_events``), signed as Stripe signs them, posted in the CLI's order and
shuffled, with a real worker, the kit's SMTP server and its stand-in of the Stripe API:

* every event is answered 200, and the thin events ``stripe listen`` forwards to the same URL
  (``--forward-thin-to``, or from v1.51.0 a second ``--forward-to``) are stored, ignored;
* the invoice carries no customer email: with a key, its recipient is read from the customer
  (one API call, kept on the invoice through its later events: a resend calls no more) and
  exactly one email goes out;
  without one, the dead letter says what to do; with ``--override customer:email=...`` the
  email goes out with no API at all;
* the API's failures: 500, 429 and no answer are retried by the email task, an unknown
  customer or one without an email is dead-lettered at once.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from django.test import Client

from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import invoice_email_resend_request
from invoicing.tasks import NO_RECIPIENT_WITHOUT_API
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from stack.stripe_api import ERROR, HANG, RATE_LIMITED, StripeApi
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import cli_invoice_paid_events, post_event
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)

EMAIL = "jenny.rosen@example.com"


def deliver(client: Client, events: list[dict[str, Any]]) -> None:
    statuses = [post_event(client, stripe_events.encode(event)).status_code for event in events]
    assert statuses == [200] * len(events), [e["type"] for e in events]


def customer_with_email(stripe_api: StripeApi, events: list[dict[str, Any]]) -> str:
    """The stand-in serves the events' customer with an email (given after the invoice was
    finalized: ``stripe customers update cus_... -d email=...``); its id."""
    customer = events[0]["data"]["object"]
    stripe_api.customers[customer["id"]] = {**customer, "email": EMAIL}
    return str(customer["id"])


@pytest.mark.parametrize("order", ["cli", "shuffled"])
def test_the_cli_events_are_answered_200_and_email_the_customer_read_from_the_api_once(
    client: Client, smtp: SmtpServer, stripe_api: StripeApi, order: str
) -> None:
    events = cli_invoice_paid_events()
    assert [e["type"] for e in events if e["type"].startswith("invoice.")] == [
        "invoice.created",
        "invoice.finalized",
        "invoice.paid",
        "invoice.payment_succeeded",
    ]
    customer_id = customer_with_email(stripe_api, events)
    paid = next(event["data"]["object"] for event in events if event["type"] == "invoice.paid")
    if order == "shuffled":
        random.Random(28).shuffle(events)
    with worker_thread():
        deliver(client, events)
        pipeline_quiet()
        # A later event of the invoice, its customer_email still null, keeps the address read.
        deliver(client, [stripe_events.event("invoice.payment_succeeded", paid)])
        invoice = Invoice.objects.get()
        invoice_email_resend_request(invoice_id=invoice.pk, idempotency_key="again", actor="t")
        pipeline_quiet()

    first, resent = smtp.messages
    assert first["To"] == resent["To"] == EMAIL
    assert stripe_api.requests == [f"/v1/customers/{customer_id}"]  # once: the resend read none
    invoice.refresh_from_db()
    assert (invoice.provider_customer_id, invoice.customer_email) == (customer_id, EMAIL)
    assert not DeadLetter.objects.exists()


def test_without_a_key_the_dead_letter_says_what_to_do(client: Client, smtp: SmtpServer) -> None:
    with worker_thread():
        deliver(client, cli_invoice_paid_events())
        pipeline_quiet()
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert letter.exception_message == NO_RECIPIENT_WITHOUT_API
    assert "set STRIPE_API_KEY" in letter.exception_message
    assert "--override customer:email=you@example.com" in letter.exception_message
    assert smtp.handler.attempts == 0


def test_thin_events_forwarded_to_the_same_url_are_taken_beside_the_snapshot_ones(
    client: Client, smtp: SmtpServer
) -> None:
    snapshot = cli_invoice_paid_events(customer_email="you@example.com")
    thin = [
        stripe_events.trigger_event(event_type)
        for event_type in (
            "v1.billing.meter.error_report_triggered",
            "v1.billing.meter.no_meter_found",
        )
    ]
    with worker_thread():
        deliver(client, snapshot[:6] + thin + snapshot[6:])
        pipeline_quiet()
    [message] = smtp.messages
    assert message["To"] == "you@example.com"
    thin_ids = {event["id"] for event in thin}
    stored = dict(WebhookEvent.objects.values_list("event_id", "state"))
    assert len(stored) == len(snapshot) + len(thin)
    assert {stored[event_id] for event_id in thin_ids} == {WebhookEvent.State.IGNORED}


def test_with_the_override_the_email_goes_out_without_the_api(
    client: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        deliver(client, cli_invoice_paid_events(customer_email="you@example.com"))
        pipeline_quiet()
    [message] = smtp.messages
    assert message["To"] == "you@example.com"


@pytest.mark.parametrize("fault", [ERROR, RATE_LIMITED, HANG])
def test_an_api_failure_that_may_pass_is_retried_by_the_email_task(
    client: Client, smtp: SmtpServer, stripe_api: StripeApi, fault: str
) -> None:
    events = cli_invoice_paid_events()
    customer_with_email(stripe_api, events)
    stripe_api.fail_next(fault)
    with worker_thread():
        deliver(client, events)
        assert wait_until(lambda: len(smtp.messages) == 1, timeout=20)
        pipeline_quiet()
    [message] = smtp.messages
    assert message["To"] == EMAIL
    assert EmailDelivery.objects.get().attempts == 2
    assert len(stripe_api.requests) == 2
    assert not DeadLetter.objects.exists()


@pytest.mark.parametrize(
    ("served", "words"),
    [
        (False, "HTTP 404, No such customer: '{id}'"),
        (True, "invoice has no customer email, nor has its customer {id}"),
    ],
)
def test_an_unknown_customer_or_one_without_email_is_dead_lettered_at_once(
    client: Client, smtp: SmtpServer, stripe_api: StripeApi, served: bool, words: str
) -> None:
    events = cli_invoice_paid_events()
    customer = events[0]["data"]["object"]
    if served:
        stripe_api.customers[customer["id"]] = customer  # as the CLI made it: no email
    with worker_thread():
        deliver(client, events)
        assert wait_until(DeadLetter.objects.exists, timeout=20)
        pipeline_quiet()
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert words.format(id=customer["id"]) in letter.exception_message
    assert len(stripe_api.requests) == 1
    assert smtp.handler.attempts == 0
