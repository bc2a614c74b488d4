"""Sending through a provider's API: django-anymail's own Postmark backend, its API URL pointed
at a stand-in of Postmark's documented email API (``stack.postmark``), and each of its answers
ending as it should: a success, an invalid recipient, an inactive one, a 500 then a success, a
429 with Retry-After, a request that times out; then bounces and complaints coming back through
Postmark's tracking webhook, verified by anymail, to a dead letter an operator fixes."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from asyncwork.contrib import mail as contrib_mail
from asyncwork.contrib.periodic.alert import dlq_alert
from asyncwork.deadletters import replay, subjects
from asyncwork.errors import PermanentError, TransientError, Unreachable
from asyncwork.models import DeadLetter
from invoicing import tasks
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import invoice_recipient_correct
from invoicing.tasks import email_breaker, invoice_email_key, send_invoice_email
from stack.net import wait_until
from stack.postmark import ERROR, HANG, RATE_LIMITED, PostmarkApi
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 1  # seconds: EMAIL_TIMEOUT, a provider API's request timeout too
WEBHOOK_AUTH = "postmark:webhook-secret-for-tests"
TRACKING_URL = "/webhooks/email/postmark/tracking/"


@pytest.fixture
def postmark(settings: Any) -> Iterator[PostmarkApi]:
    """The stand-in, and Django sending through anymail's Postmark backend to it."""
    with PostmarkApi(hang_seconds=TIMEOUT + 2) as api:
        settings.EMAIL_BACKEND = "anymail.backends.postmark.EmailBackend"
        settings.ANYMAIL = {
            "POSTMARK_SERVER_TOKEN": api.token,
            "POSTMARK_API_URL": api.url,
            "WEBHOOK_SECRET": WEBHOOK_AUTH,
        }
        settings.EMAIL_TIMEOUT = TIMEOUT
        settings.EMAIL_BREAKER_FAILURE_THRESHOLD = 3
        yield api


def _sent(invoice: Invoice) -> EmailDelivery:
    return EmailDelivery.objects.get(key=invoice_email_key(invoice.pk))


def _run(*invoices: Invoice, until: Any, timeout: float = 30) -> None:
    with worker_thread():
        for invoice in invoices:
            send_invoice_email.enqueue(invoice.pk)
        assert wait_until(until, timeout=timeout)
        pipeline_quiet()


def _state(invoice: Invoice) -> str | None:
    return (
        EmailDelivery.objects.filter(key=invoice_email_key(invoice.pk))
        .values_list("state", flat=True)
        .first()
    )


def _letter(invoice: Invoice) -> DeadLetter:
    return DeadLetter.objects.get(args=[invoice.pk])


# --- each answer, classified (the real backend, over HTTP) ------------------------------------


def _deliver(invoice: Invoice) -> None:
    message = tasks.invoice_email_build(
        invoice=invoice, message_id="<t.1@example.com>", key=invoice_email_key(invoice.pk)
    )
    contrib_mail.deliver(message)


def test_each_postmark_answer_is_sorted_as_the_task_takes_it(postmark: PostmarkApi) -> None:
    invoice = paid_invoice()

    _deliver(invoice)
    assert [m["To"] for m in postmark.sent] == [invoice.recipient]

    postmark.invalid.add(invoice.recipient)
    for quotes_address in (True, False):
        postmark.quotes_address = quotes_address
        with pytest.raises(contrib_mail.RecipientRejected, match="Invalid 'To' address") as refused:
            _deliver(invoice)
        assert str(refused.value).startswith("recipient refused: Postmark 422: ")
    postmark.invalid.clear()

    postmark.inactive.add(invoice.recipient)
    with pytest.raises(contrib_mail.RecipientRejected, match="marked as inactive"):
        _deliver(invoice)
    postmark.inactive.clear()

    postmark.fail_next(ERROR)
    with pytest.raises(Unreachable, match="email provider unavailable: Postmark 500"):
        _deliver(invoice)

    postmark.retry_after = 7
    postmark.fail_next(RATE_LIMITED)
    with pytest.raises(TransientError, match="rate limit") as limited:
        _deliver(invoice)
    assert not isinstance(limited.value, Unreachable)  # answered: not the breaker's business
    assert limited.value.retry_after == 7

    postmark.fail_next(HANG)
    started = time.monotonic()
    with pytest.raises(Unreachable, match="email provider unreachable"):
        _deliver(invoice)
    assert time.monotonic() - started < TIMEOUT + 1

    postmark.token = "another-servers-token"
    with pytest.raises(PermanentError, match="refused the message: Postmark 401"):
        _deliver(invoice)
    assert len(postmark.sent) == 1


def test_the_delivery_key_travels_as_postmark_metadata_with_our_message_id(
    postmark: PostmarkApi,
) -> None:
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    delivery = _sent(invoice)
    assert message["Metadata"] == {"delivery_key": delivery.key}
    assert {"Name": "Message-ID", "Value": delivery.message_id} in message["Headers"]
    assert delivery.recipient == invoice.recipient
    # Postmark's own id for it, which its bounce will name.
    assert delivery.provider_message_id == message["MessageID"]


# --- end to end, through a real worker --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "quotes_address", "quoted"),
    [
        ("", False, "{address}"),
        ("Ada Lovelace", True, "{address}"),
        # anymail reads the quoted To whole as one address: ours is left "unknown" and no
        # exception raised, so send() returns 1 for a message Postmark refused.
        ("Ada Lovelace", False, "Ada Lovelace <{address}>"),
    ],
)
def test_an_invalid_recipient_is_dead_lettered_at_once_in_postmarks_words(
    postmark: PostmarkApi, name: str, quotes_address: bool, quoted: str
) -> None:
    invoice = paid_invoice(customer_name=name)
    postmark.invalid.add(invoice.recipient)
    postmark.quotes_address = quotes_address
    _run(invoice, until=lambda: DeadLetter.objects.exists())
    letter = _letter(invoice)
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert letter.exception_class == "asyncwork.contrib.mail.RecipientRejected"
    assert letter.exception_message == (
        "recipient refused: Postmark 422: Invalid 'To' address: "
        f"'{quoted.format(address=invoice.recipient)}'."
    )
    assert postmark.requests == 1
    assert postmark.sent == []
    assert email_breaker().state()["failures"] == 0
    delivery = _sent(invoice)
    assert (delivery.state, delivery.sent_at) == ("failed", None)


def test_an_answer_about_another_address_is_never_counted_sent(postmark: PostmarkApi) -> None:
    """The provider refused the request but named an address we did not send to: ours has no
    status of its own, so nothing says it was sent; a dead letter in the provider's words, not
    retried (a send that may have gone out is not repeated blindly)."""
    invoice = paid_invoice(customer_name="Ada Lovelace")
    postmark.invalid.add(invoice.recipient)
    postmark.misnamed = "someone-else@example.com"
    _run(invoice, until=lambda: DeadLetter.objects.exists())
    letter = _letter(invoice)
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert letter.exception_class == "asyncwork.errors.PermanentError"
    assert letter.exception_message == (
        "email provider did not accept the message for its recipient (status unknown for "
        f"{invoice.recipient}): Postmark 422: Invalid 'To' address: 'someone-else@example.com'."
    )
    assert postmark.requests == 1
    assert _sent(invoice).state == "failed"


def test_a_500_then_a_success_sends_one_email(postmark: PostmarkApi) -> None:
    invoice = paid_invoice()
    postmark.fail_next(ERROR)
    _run(invoice, until=lambda: _state(invoice) == "sent")
    assert postmark.requests == 2
    assert len(postmark.sent_to(invoice.recipient)) == 1
    assert _sent(invoice).attempts == 2
    assert not DeadLetter.objects.exists()


def test_a_429_is_retried_after_its_retry_after_and_does_not_count_toward_the_breaker(
    postmark: PostmarkApi, settings: Any
) -> None:
    # One failure would open the breaker, and a deferred job is sent only after its cool-down:
    # the 429 must not count.
    settings.EMAIL_BREAKER_FAILURE_THRESHOLD = 1
    settings.EMAIL_BREAKER_RESET_SECONDS = 60
    postmark.retry_after = 2  # the test settings' longest retry wait (EMAIL_RETRY_BACKOFF_MAX)
    invoice = paid_invoice()
    postmark.fail_next(RATE_LIMITED)
    started = time.monotonic()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    assert time.monotonic() - started >= 2
    assert postmark.requests == 2
    assert len(postmark.sent_to(invoice.recipient)) == 1
    assert email_breaker().state()["state"] == "closed"


def test_a_request_that_times_out_is_retried_and_sends_one_email(postmark: PostmarkApi) -> None:
    invoice = paid_invoice()
    postmark.fail_next(HANG)
    _run(invoice, until=lambda: _state(invoice) == "sent")
    assert postmark.requests == 2
    assert len(postmark.sent_to(invoice.recipient)) == 1
    assert not DeadLetter.objects.exists()


# --- bounces close the loop -------------------------------------------------------------------


def _post(client: Client, event: dict[str, Any], credentials: str = WEBHOOK_AUTH) -> int:
    """Post ``event`` as Postmark does, with basic auth (the URL's user:password)."""
    auth = "Basic " + base64.b64encode(credentials.encode()).decode()
    response = client.post(
        TRACKING_URL,
        json.dumps(event),
        content_type="application/json",
        headers={"Authorization": auth},
    )
    return response.status_code


def test_a_bounce_marks_the_delivery_and_the_operator_fixes_it_like_any_dead_letter(
    postmark: PostmarkApi, client: Client
) -> None:
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    bounce = postmark.bounce_event(message)

    assert _post(client, bounce, credentials="postmark:wrong") == 400
    assert not DeadLetter.objects.exists()

    assert _post(client, bounce) == 200
    assert _post(client, bounce) == 200  # the provider delivering it again: nothing more
    letter = _letter(invoice)
    assert letter.reason == "permanent"
    assert letter.exception_class == "asyncwork.contrib.mail.RecipientRejected"
    assert letter.exception_message == (
        "bounced: The server was unable to deliver your message (ex: unknown user, mailbox not "
        "found). (smtp;550 5.1.1 The email account that you tried to reach does not exist.)"
    )
    delivery = _sent(invoice)
    assert delivery.state == "bounced"
    assert delivery.bounced_at is not None

    # Replayed as it stands, it would only bounce again: refused, saying why.
    refused = replay(ids=[letter.pk], actor="test")
    assert refused.replayed == []
    assert refused.refused == {
        letter.pk: f"it failed on its recipient address ({invoice.recipient}), which is "
        "unchanged: correct the recipient first"
    }
    assert subjects([letter])[letter.pk].outcome.startswith("email bounced ")

    # The operator corrects the recipient and replays: the email goes out, to the new address.
    invoice_recipient_correct(
        invoice_id=invoice.pk, email="fixed@example.com", reason="typo", actor="test"
    )
    assert replay(ids=[letter.pk], actor="test").replayed == [letter.pk]
    with worker_thread():
        assert wait_until(lambda: len(postmark.sent_to("fixed@example.com")) == 1, timeout=30)
        pipeline_quiet()
    delivery.refresh_from_db()
    assert (delivery.state, delivery.recipient) == ("sent", "fixed@example.com")
    letter.refresh_from_db()
    assert subjects([letter])[letter.pk].outcome == (
        f"email sent {delivery.sent_at:%Y-%m-%d %H:%M} UTC to fixed@example.com"
    )

    # A late bounce for the old address changes nothing now.
    assert _post(client, postmark.bounce_event(message)) == 200
    delivery.refresh_from_db()
    assert delivery.state == "sent"
    assert DeadLetter.objects.count() == 1
    assert len(postmark.sent) == 2


def test_a_bounce_must_name_the_address_and_the_message_last_sent(
    postmark: PostmarkApi, client: Client
) -> None:
    """The delivery key counts up, so whoever holds the webhook's one secret could guess it: a
    bounce counts only if it also names the address and Postmark's id of the email last sent."""
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    bounce = postmark.bounce_event(message)
    for forged in (
        {**bounce, "Email": ""},
        {**bounce, "Email": "someone-else@example.com"},
        {**bounce, "MessageID": "00000000-0000-0000-0000-000000000000"},
    ):
        assert _post(client, forged) == 200  # taken, so Postmark does not post it again
    assert not DeadLetter.objects.exists()
    assert _state(invoice) == "sent"

    assert _post(client, bounce) == 200
    assert _letter(invoice).exception_message.startswith("bounced: ")
    assert _state(invoice) == "bounced"


def test_a_complaint_is_a_dead_letter_in_the_providers_words(
    postmark: PostmarkApi, client: Client
) -> None:
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    assert _post(client, postmark.complaint_event(message)) == 200
    assert _letter(invoice).exception_message.startswith(
        "complained: The subscriber explicitly marked this message as spam."
    )
    assert _sent(invoice).state == "bounced"


def test_a_rejection_is_a_dead_letter_in_the_providers_words(
    postmark: PostmarkApi, client: Client
) -> None:
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    rejected = postmark.bounce_event(
        message,
        kind="BadEmailAddress",
        description="Invalid email address — The address is not a valid email address.",
        details="Invalid email address",
    )
    assert _post(client, rejected) == 200
    assert _letter(invoice).exception_message == (
        "rejected: Invalid email address — The address is not a valid email address. "
        "(Invalid email address)"
    )
    assert _state(invoice) == "bounced"


def test_tracking_events_of_others_and_deliveries_change_nothing(
    postmark: PostmarkApi, client: Client
) -> None:
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    delivered = {
        "RecordType": "Delivery",
        "MessageID": message["MessageID"],
        "Recipient": invoice.recipient,
        "DeliveredAt": "2026-12-03T10:00:00Z",
        "Details": "Test delivery webhook details",
        "Tag": "",
        "ServerID": 23,
        "Metadata": message["Metadata"],
        "MessageStream": "outbound",
    }
    foreign = postmark.bounce_event({**message, "Metadata": {}})
    unknown_key = postmark.bounce_event({**message, "Metadata": {"delivery_key": "nope"}})
    for event in (delivered, foreign, unknown_key):
        assert _post(client, event) == 200
    assert not DeadLetter.objects.exists()
    assert _sent(invoice).state == "sent"


def test_without_a_webhook_secret_the_tracking_webhook_is_off(
    postmark: PostmarkApi, client: Client, settings: Any
) -> None:
    """anymail alone would take anyone's post (it only warns): a forged bounce must not land."""
    invoice = paid_invoice()
    _run(invoice, until=lambda: _state(invoice) == "sent")
    (message,) = postmark.sent
    settings.ANYMAIL = {k: v for k, v in settings.ANYMAIL.items() if k != "WEBHOOK_SECRET"}
    response = client.post(
        TRACKING_URL, json.dumps(postmark.bounce_event(message)), content_type="application/json"
    )
    assert response.status_code == 404
    assert response.json() == {
        "error": "email tracking webhooks are off: ANYMAIL_WEBHOOK_SECRET is not set"
    }
    assert not DeadLetter.objects.exists()
    assert _state(invoice) == "sent"


def test_the_dead_letter_alert_says_which_provider_it_went_through(
    postmark: PostmarkApi, settings: Any
) -> None:
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.ASYNCWORK = {**settings.ASYNCWORK, "DLQ_ALERT_THRESHOLD": 1}
    invoice = paid_invoice()
    postmark.invalid.add(invoice.recipient)
    _run(invoice, until=lambda: DeadLetter.objects.exists())
    cache.delete("dlq-alert-sent")
    try:
        assert dlq_alert() == 1
    finally:
        cache.delete("dlq-alert-sent")
    [alert] = postmark.sent_to("ops@example.com")
    assert alert["Subject"] == "[Django] Dead-letter queue depth 1"
    assert (
        "This alert went through Postmark's API (anymail.backends.postmark.EmailBackend)."
        in alert["TextBody"]
    )
