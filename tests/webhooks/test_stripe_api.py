"""The optional Stripe API client, the real stripe-python client against the kit's stand-in
(``stack.stripe_api``): off without a key (said in /health/'s details, never as degraded, and
in one line as a worker starts); with one, each failure sorted as the email task needs it (no
answer, 429, 5xx or a body that is not JSON may pass; 404 or a refused key will not); and the
events listed and paged as Stripe lists them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import stripe
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from asyncwork.errors import PermanentError, TransientError
from stack import launch, stripe_events
from stack.smtp import SmtpServer
from stack.stripe_api import StripeApi
from tests.helpers.processes import worker_env
from tests.helpers.stripe import API_FAULT_WORDS
from webhooks.stripe_api import API_OFF, stripe_client, stripe_error_sorted


def customer_read(customer_id: str) -> Any:
    """One call through the application's client, its failure sorted as the email task does."""
    client = stripe_client()
    assert client is not None
    try:
        return client.v1.customers.retrieve(customer_id)
    except stripe.StripeError as exc:
        raise stripe_error_sorted(exc, doing=f"reading customer {customer_id}") from exc


@pytest.fixture
def customer(stripe_api: StripeApi) -> dict[str, Any]:
    obj = stripe_events.customer_object(customer_email="ada@example.com")
    stripe_api.customers[obj["id"]] = obj
    return obj


def test_without_a_key_there_is_no_client() -> None:
    assert stripe_client() is None


def test_the_client_reads_a_customer_with_its_key(
    stripe_api: StripeApi, customer: dict[str, Any]
) -> None:
    read = customer_read(customer["id"])
    assert (read.id, read.email) == (customer["id"], "ada@example.com")
    assert stripe_api.requests == [f"/v1/customers/{customer['id']}"]
    assert stripe_api.versions == [settings.STRIPE_API_VERSION]  # the handlers' version


@pytest.mark.parametrize(("fault", "words"), API_FAULT_WORDS)
def test_no_answer_429_5xx_and_malformed_bodies_are_transient_and_asked_once(
    stripe_api: StripeApi, customer: dict[str, Any], fault: str, words: str
) -> None:
    stripe_api.fail_next(fault)
    started = time.monotonic()
    with pytest.raises(TransientError) as failed:
        customer_read(customer["id"])
    assert str(failed.value) == f"Stripe API, reading customer {customer['id']}: {words}"
    assert time.monotonic() - started < stripe_api.hang_seconds - 1  # the 1 s timeout, not more
    assert len(stripe_api.requests) == 1  # no retry inside the call: the job retries
    assert customer_read(customer["id"]).email == "ada@example.com"  # the fault has passed


def test_an_unknown_customer_is_permanent(stripe_api: StripeApi) -> None:
    with pytest.raises(PermanentError) as failed:
        customer_read("cus_missing")
    assert str(failed.value) == (
        "Stripe API, reading customer cus_missing: HTTP 404, No such customer: 'cus_missing'"
    )


def test_a_refused_key_is_permanent(
    stripe_api: StripeApi, customer: dict[str, Any], settings: Any
) -> None:
    settings.STRIPE_API_KEY = "rk_test_revoked"
    with pytest.raises(PermanentError, match="HTTP 401, Invalid API Key provided"):
        customer_read(customer["id"])


def test_a_connection_refused_is_transient(settings: Any) -> None:
    with StripeApi() as gone:
        settings.STRIPE_API_KEY, settings.STRIPE_API_BASE = gone.key, gone.url
    with pytest.raises(TransientError, match="ConnectionError"):
        customer_read("cus_any")


def test_events_are_listed_newest_first_filtered_and_paged_as_stripe_does(
    stripe_api: StripeApi,
) -> None:
    now = int(time.time())
    kinds = ["invoice.paid", "customer.created", "invoice.payment_succeeded"]
    for n in range(30):
        event = stripe_events.event(kinds[n % 3], {"id": f"in_{n}"}, created=now - 100 + n)
        stripe_api.event_add(event, delivered=n % 2 == 0)
    client = stripe_client()
    assert client is not None

    listed = client.v1.events.list(
        {
            "types": ["invoice.paid", "invoice.payment_succeeded"],
            "created": {"gte": now - 90},
            "delivery_success": False,
            "limit": 3,
        }
    )
    every = [event.data.object["id"] for event in listed.auto_paging_iter()]

    wanted = [n for n in range(10, 30) if n % 3 != 1 and n % 2 == 1]
    assert every == [f"in_{n}" for n in reversed(wanted)]
    assert len(stripe_api.requests) == 3  # 7 events, 3 a page
    assert "starting_after=" in stripe_api.requests[1]
    assert client.v1.events.retrieve(listed.data[0].id).type == listed.data[0].type


@pytest.mark.django_db(transaction=True)  # the checks run on their own connections
def test_health_says_the_api_is_off_without_degrading(client: Client) -> None:
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    body = client.get("/health/").json()
    assert body["checks"]["stripe_api"] == {
        "status": "ok",
        "api": "off",
        "why": API_OFF,
        "critical": False,
        "ms": body["checks"]["stripe_api"]["ms"],
    }
    assert "stripe_api" not in body["degraded"]


@pytest.mark.django_db(transaction=True)
def test_health_names_the_api_it_reads_with_a_key(client: Client, stripe_api: StripeApi) -> None:
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    check = client.get("/health/").json()["checks"]["stripe_api"]
    assert (check["status"], check["api"], check["base"]) == ("ok", "on", stripe_api.url)
    assert stripe_api.requests == []  # configuration only: /health/ never calls Stripe


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_says_once_as_it_starts_that_the_api_is_off(smtp: SmtpServer) -> None:
    worker = launch.celery_worker(worker_env(smtp.port), name="stripe-api-off")
    try:
        worker.wait_ready()
        log = worker.log_text()
    finally:
        worker.stop()
    [line] = [line for line in log.splitlines() if API_OFF in line]
    assert "INFO" in line
