"""POST /webhooks/stripe/ against the real PostgreSQL."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from asyncwork.models import Job
from invoicing.models import Invoice
from invoicing.tasks import send_invoice_email
from stack import stripe_events
from tests.helpers.stripe import SECRET, WEBHOOK_URL, paid_event, post_event
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db


def test_valid_paid_event_is_stored_applied_and_acknowledged(client: Client) -> None:
    event = paid_event(
        "in_valid001",
        customer_email="a@example.com",
        amount=1999,
        currency="eur",
        number="INV-0001",
    )
    body = stripe_events.encode(event)

    response = post_event(client, body)

    assert response.status_code == 200
    assert response.json() == {
        "received": True,
        "event_id": event["id"],
        "type": "invoice.paid",
        "duplicate": False,
        "handled": True,
    }
    stored = WebhookEvent.objects.get()
    assert stored.event_id == event["id"]
    assert stored.body == body.decode()  # the raw body, byte for byte
    assert stored.headers["Stripe-Signature"].startswith("t=")
    assert stored.state == WebhookEvent.State.PROCESSED
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.number, invoice.customer_email) == (
        "in_valid001",
        "INV-0001",
        "a@example.com",
    )
    assert (invoice.amount_paid, invoice.currency, invoice.status) == (1999, "eur", "paid")
    assert invoice.paid_at is not None
    job = Job.objects.get()
    assert (job.task, job.args) == (send_invoice_email.module_path, [invoice.pk])


def test_other_event_types_are_stored_and_ignored(client: Client) -> None:
    event = stripe_events.event("customer.created", stripe_events.customer_object())
    response = post_event(client, stripe_events.encode(event))
    assert response.status_code == 200
    # The sender is told no handler acted: a developer sees their handler is not declared.
    assert (response.json()["type"], response.json()["handled"]) == ("customer.created", False)
    assert WebhookEvent.objects.get().state == WebhookEvent.State.IGNORED
    assert not Invoice.objects.exists()
    assert not Job.objects.exists()


def test_missing_optional_fields_and_unknown_fields_do_not_fail(client: Client) -> None:
    event = stripe_events.event(
        "invoice.payment_succeeded",
        {
            "id": "in_minimal",
            "object": "invoice",
            "brand_new_field": {"x": [1, 2]},
        },
    )
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    invoice = Invoice.objects.get()
    assert (invoice.status, invoice.number, invoice.customer_email) == ("paid", "", "")


def _body() -> bytes:
    return stripe_events.encode(paid_event())


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing Stripe-Signature header"),
        ("", "missing Stripe-Signature header"),
        ("garbage", "malformed Stripe-Signature header"),
        ("t=abc,v1=00", "malformed Stripe-Signature header"),
        ("t=1,t=2,v1=00", "malformed Stripe-Signature header"),
        ("t=%(now)s,v1=é", "malformed Stripe-Signature header"),
        ("t=%(now)s,v1=" + "0" * 64, "no signature matches"),
        ("t=%(now)s,v0=" + "0" * 64, "no v1 signature in Stripe-Signature header"),
    ],
)
def test_bad_signature_headers_are_400_and_store_nothing(
    client: Client, header: str | None, reason: str
) -> None:
    extra: dict[str, Any] = {}
    if header is not None:
        extra["HTTP_STRIPE_SIGNATURE"] = header % {"now": int(time.time())}
    response = client.post(WEBHOOK_URL, data=_body(), content_type="application/json", **extra)
    assert response.status_code == 400
    assert response.json() == {"error": reason}
    assert not WebhookEvent.objects.exists()


def test_only_a_fake_v0_signature_is_refused(client: Client) -> None:
    body = _body()
    good = stripe_events.signature_header(body, SECRET)
    v0_only = good.replace("v1=", "v0=")
    response = post_event(client, body, header=v0_only)
    assert response.status_code == 400
    assert not WebhookEvent.objects.exists()


def test_stripe_cli_shape_with_fake_v0_beside_v1_is_accepted(client: Client) -> None:
    body = _body()
    header = stripe_events.signature_header(body, SECRET, with_v0=True)
    assert ",v0=" in header
    assert post_event(client, body, header=header).status_code == 200


def test_signature_from_a_different_secret_is_refused(client: Client) -> None:
    response = post_event(client, _body(), secret="whsec_someone_else")
    assert response.status_code == 400
    assert response.json()["error"] == "no signature matches"
    assert not WebhookEvent.objects.exists()


@pytest.mark.parametrize(
    ("post", "status", "reason"),
    [
        (
            lambda c: post_event(c, _body(), secret="whsec_someone_else"),
            400,
            "no signature matches",
        ),
        (lambda c: post_event(c, b"", header="t=1,v1=00"), 400, "empty body"),
    ],
    ids=["bad-signature", "empty-body"],
)
def test_a_rejected_delivery_is_logged_once(
    client: Client, caplog: pytest.LogCaptureFixture, post: Any, status: int, reason: str
) -> None:
    """The view's line, with the reason; not Django's "Bad Request" line for it as well."""
    with caplog.at_level(logging.DEBUG):  # every logger, django.request included
        response = post(client)
    assert response.status_code == status
    lines = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.levelno >= logging.INFO and not r.name.startswith("django.db")
    ]
    assert lines == [("webhooks.stripe", "WARNING", f"webhook rejected: {reason}")]


def test_rotation_accepts_either_secret_and_any_v1(client: Client) -> None:
    body = _body()
    assert post_event(client, body, secret="whsec_test_rolled").status_code == 200
    # During a roll Stripe sends one v1 per secret; a bad one first must not hide a good one.
    body2 = _body()
    good = stripe_events.signature_header(body2, SECRET)
    timestamp, v1 = good.split(",")
    header = f"{timestamp},v1={'f' * 64},{v1}"
    assert post_event(client, body2, header=header).status_code == 200
    assert WebhookEvent.objects.count() == 2


@pytest.mark.parametrize(
    ("offset", "status", "reason"),
    [
        (-290, 200, None),
        (290, 200, None),
        (-310, 400, "signature timestamp too old"),
        (310, 400, "signature timestamp in the future"),
    ],
)
def test_timestamp_tolerance_in_both_directions(
    client: Client, offset: int, status: int, reason: str | None
) -> None:
    response = post_event(client, _body(), timestamp=int(time.time()) + offset)
    assert response.status_code == status
    if reason:
        assert response.json()["error"] == reason
        assert not WebhookEvent.objects.exists()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'\xff\xfe{"id": 1}', "body is not UTF-8"),
        (b"{not json", "body is not JSON"),
        (b"[1, 2]", "body is not a JSON object"),
        (b'{"type": "invoice.paid"}', "event has no id"),
        (b'{"id": "evt_1"}', "event has no type"),
        (b'{"id": "", "type": "invoice.paid"}', "event has no id"),
        (b'{"id": "evt_1", "type": "invoice.paid", "data": {}}', "data.object is missing"),
        (
            b'{"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_1", '
            b'"amount_paid": "12"}}}',
            "amount_paid is not a non-negative integer",
        ),
        (
            b'{"id": "evt_1", "type": "x", "created": 99999999999999}',
            "created is not a plausible timestamp",
        ),
        (b'{"id": "evt\\u0000", "type": "x"}', "event id is malformed"),
        (b'{"id": "evt_1", "type": "x", "pad": "\x00"}', "body contains a NUL byte"),
    ],
)
def test_bad_bodies_are_400_and_store_nothing(client: Client, body: bytes, reason: str) -> None:
    response = post_event(client, body)
    assert response.status_code == 400
    assert response.json() == {"error": reason}
    assert not WebhookEvent.objects.exists()
    assert not Invoice.objects.exists()


def test_empty_body_is_400(client: Client) -> None:
    response = post_event(client, b"")
    assert response.status_code == 400


def test_body_over_one_mebibyte_is_413(client: Client) -> None:
    event = paid_event()
    event["padding"] = "x" * (1024 * 1024)
    response = post_event(client, stripe_events.encode(event))
    assert response.status_code == 413
    assert not WebhookEvent.objects.exists()


@pytest.mark.parametrize("method", ["get", "put", "patch", "delete", "head", "options"])
def test_other_methods_are_405(client: Client, method: str) -> None:
    response = getattr(client, method)(WEBHOOK_URL)
    assert response.status_code == 405
    assert response["Allow"] == "POST"


def test_sequential_duplicate_answers_200_and_changes_nothing(client: Client) -> None:
    body = _body()
    first = post_event(client, body)
    invoice_before = Invoice.objects.values().get()
    second = post_event(client, body)  # a provider retry: new t, new signature, same event
    assert (first.status_code, second.status_code) == (200, 200)
    assert (first.json()["duplicate"], first.json()["handled"]) == (False, True)
    # The retry changed nothing: no handler acted on it.
    assert (second.json()["duplicate"], second.json()["handled"]) == (True, False)
    assert WebhookEvent.objects.count() == 1
    assert Invoice.objects.values().get() == invoice_before
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_deliveries_store_one_row_and_log_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = _body()
    barrier = threading.Barrier(20)
    statuses: list[int] = []
    errors: list[BaseException] = []

    def deliver() -> None:
        try:
            client = Client()
            barrier.wait()
            statuses.append(post_event(client, body).status_code)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=deliver) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    assert errors == []
    assert statuses == [200] * 20
    assert WebhookEvent.objects.count() == 1
    assert Invoice.objects.count() == 1
    assert Job.objects.count() == 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.django_db(transaction=True)
def test_concurrent_paid_and_payment_succeeded_for_one_invoice_write_one_job() -> None:
    events = [
        stripe_events.encode(paid_event("in_race", event_type=t))
        for t in ("invoice.paid", "invoice.payment_succeeded")
    ]
    bodies = [body for body in events for _ in range(5)]
    barrier = threading.Barrier(len(bodies))
    statuses: list[int] = []

    def deliver(body: bytes) -> None:
        try:
            barrier.wait()
            statuses.append(post_event(Client(), body).status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses) == [200] * 10
    assert WebhookEvent.objects.count() == 2
    assert Invoice.objects.count() == 1
    assert Job.objects.count() == 1


def test_stale_event_for_a_paid_invoice_changes_nothing(client: Client) -> None:
    now = int(time.time())
    newer = paid_event("in_order", created=now, customer_email="new@example.com")
    older = paid_event(
        "in_order",
        created=now - 60,
        customer_email="old@example.com",
        event_type="invoice.payment_succeeded",
    )
    assert post_event(client, stripe_events.encode(newer)).status_code == 200
    before = Invoice.objects.values().get()
    assert post_event(client, stripe_events.encode(older)).status_code == 200
    assert Invoice.objects.values().get() == before
    assert WebhookEvent.objects.count() == 2  # stored, but without effect
    assert Job.objects.count() == 1


def test_a_paid_invoice_stays_paid(client: Client) -> None:
    now = int(time.time())
    post_event(client, stripe_events.encode(paid_event("in_stay", created=now)))
    # A later event claiming the invoice is open (as a misordered replay could) keeps it paid.
    later = paid_event("in_stay", created=now + 5, status="open")
    assert post_event(client, stripe_events.encode(later)).status_code == 200
    assert Invoice.objects.get().status == "paid"
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_database_unavailable_answers_503_with_retry_after(client: Client) -> None:
    body = _body()
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # nothing listens there: a real refused connection
    try:
        response = post_event(client, body)
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port
    assert response.status_code == 503
    assert int(response["Retry-After"]) > 0
    assert json.loads(response.content) == {"error": "temporarily unavailable"}
    assert not WebhookEvent.objects.exists()


# --- Hostile text in a signed event -----------------------------------------------------------
# A lone surrogate is valid JSON (the ASCII escape \ud800) and a valid signed body, but UTF-8
# cannot encode it: stored as it is, the INSERT fails (a 500, on every retry, for three days).


def _signed_json(event: dict[str, Any]) -> bytes:
    body = json.dumps(event, indent=2).encode()
    assert b"\\ud" in body  # the escapes really are in the signed bytes
    return body


@pytest.mark.parametrize(
    "field", ["customer_name", "number", "customer_email", "hosted_invoice_url"]
)
def test_unencodable_text_in_a_kept_field_is_stored_made_safe(client: Client, field: str) -> None:
    event = paid_event("in_hostile")
    event["data"]["object"][field] = "ab\ud800cd\x00e\udfff"
    # Unknown fields, nested, with lone surrogates in keys and values: kept in the raw body only.
    event["data"]["object"]["lines"]["x\udfff"] = {"deep": ["\ud83d", "\x00", {"\ud800": 1}]}
    body = _signed_json(event)

    response = post_event(client, body)

    assert response.status_code == 200
    stored = WebhookEvent.objects.get()
    assert stored.body.encode() == body  # the raw body, byte for byte as signed
    assert stored.state == WebhookEvent.State.PROCESSED
    invoice = Invoice.objects.get()
    assert getattr(invoice, field) == "ab\ufffdcde\ufffd"  # replaced, NUL dropped: storable
    assert invoice.status == "paid"
    assert Job.objects.count() == 1  # the receipt is still asked for


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (["id"], "evt_\ud800", "event id is malformed"),
        (["type"], "invoice.paid\udfff", "event type is malformed"),
        (["data", "object", "id"], "in_\ud800", "data.object.id is malformed"),
        (["data", "object", "id"], "in_1\x1c", "data.object.id is malformed"),
        (["data", "object", "id"], " in_1", "data.object.id is malformed"),
        (["data", "object", "id"], 42, "data.object.id is malformed"),
        (["data", "object", "currency"], "u\ud800d", "data.object.currency is not a 3-letter code"),
    ],
)
def test_malformed_identifiers_are_400_and_store_nothing(
    client: Client, path: list[str], value: Any, reason: str
) -> None:
    event = paid_event()
    target = event
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    response = post_event(client, json.dumps(event).encode())

    assert response.status_code == 400
    assert response.json() == {"error": reason}
    assert not WebhookEvent.objects.exists()
    assert not Invoice.objects.exists()


def test_kept_headers_are_stored_made_safe(client: Client) -> None:
    # Under WSGI, META holds Latin-1 text; whatever a server puts there, storing cannot fail.
    body = _body()
    response = post_event(client, body, HTTP_USER_AGENT="agent\ud800\x00/1", REMOTE_ADDR="\x00")
    assert response.status_code == 200
    stored = WebhookEvent.objects.get()
    assert stored.headers["User-Agent"] == "agent\ufffd/1"
    assert stored.headers["Remote-Addr"] == ""
    assert stored.body.encode() == body


# --- Mode and account ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "livemode", "acted_on"),
    [
        ("live", True, True),
        ("live", False, False),
        ("test", False, True),
        ("test", True, False),
        ("any", True, True),
        ("any", False, True),
    ],
)
def test_an_event_of_the_other_mode_is_stored_ignored_and_changes_nothing(
    client: Client, settings: Any, mode: str, livemode: bool, acted_on: bool
) -> None:
    settings.STRIPE_LIVEMODE = mode
    event = paid_event()
    event["livemode"] = livemode

    response = post_event(client, stripe_events.encode(event))

    assert response.status_code == 200
    assert response.json()["duplicate"] is False
    assert response.json()["handled"] is acted_on
    row = WebhookEvent.objects.get()
    assert row.livemode is livemode
    if acted_on:
        assert (row.state, row.error) == (WebhookEvent.State.PROCESSED, "")
        assert Invoice.objects.get().status == "paid"
        assert Job.objects.count() == 1
    else:
        kind = "live" if livemode else "test"
        assert row.state == WebhookEvent.State.IGNORED
        assert row.error == f"{kind}-mode event; STRIPE_LIVEMODE is {mode}"
        assert not Invoice.objects.exists()
        assert not Job.objects.exists()


def test_live_mode_acts_only_on_an_explicit_livemode_true(client: Client, settings: Any) -> None:
    settings.STRIPE_LIVEMODE = "live"
    event = paid_event()
    event["livemode"] = "true"  # not the JSON boolean
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    assert WebhookEvent.objects.get().state == WebhookEvent.State.IGNORED
    assert not Invoice.objects.exists()


def test_an_event_of_the_other_mode_is_ignored_before_its_object_is_read(
    client: Client, settings: Any
) -> None:
    # Not ours, so not ours to judge: a 400 would only have Stripe retry it for three days.
    settings.STRIPE_LIVEMODE = "test"
    event = paid_event()
    event["livemode"] = True
    event["data"] = {"object": {"id": "in_\ud800", "amount_paid": "lots"}}
    assert post_event(client, json.dumps(event).encode()).status_code == 200
    assert WebhookEvent.objects.get().state == WebhookEvent.State.IGNORED
    assert not Invoice.objects.exists()


@pytest.mark.parametrize(
    ("account", "error"),
    [
        ("acct_1Ours", ""),
        ("acct_1Theirs", "event for account 'acct_1Theirs'; STRIPE_ACCOUNT is acct_1Ours"),
        (None, "event for the platform; STRIPE_ACCOUNT is acct_1Ours"),
        ("acct_\ud800", "event for account 'acct_\\ud800'; STRIPE_ACCOUNT is acct_1Ours"),
    ],
)
def test_with_stripe_account_set_other_accounts_events_are_ignored(
    client: Client, settings: Any, account: str | None, error: str
) -> None:
    settings.STRIPE_ACCOUNT = "acct_1Ours"
    event = paid_event()
    if account is not None:
        event["account"] = account  # Connect: the connected account the event belongs to

    assert post_event(client, json.dumps(event).encode()).status_code == 200

    row = WebhookEvent.objects.get()
    assert row.error == error
    if error:
        assert row.state == WebhookEvent.State.IGNORED
        assert not Invoice.objects.exists()
        assert not Job.objects.exists()
    else:
        assert row.state == WebhookEvent.State.PROCESSED
        assert Job.objects.count() == 1


def test_without_stripe_account_any_account_is_taken(client: Client, settings: Any) -> None:
    settings.STRIPE_ACCOUNT = ""
    event = paid_event()
    event["account"] = "acct_1Anyone"
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    assert WebhookEvent.objects.get().state == WebhookEvent.State.PROCESSED
