"""Webhook -> job -> worker -> SMTP, with a real broker (Redis, or RabbitMQ), a real worker and a
real SMTP server (aiosmtpd)."""

from __future__ import annotations

import pytest
from django.test import Client

from asyncwork.backend import TaskResultStatus, message_id
from asyncwork.models import DeadLetter, Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import send_invoice_email
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import paid_event, post_event

pytestmark = pytest.mark.django_db(transaction=True)


def test_one_paid_event_sends_one_email(client: Client, smtp: SmtpServer) -> None:
    event = paid_event(
        "in_one",
        customer_email="ada@example.com",
        customer_name="Ada Lovelace",
        amount=123456,
        currency="eur",
        number="INV-42",
    )
    with worker_thread():
        assert post_event(client, stripe_events.encode(event)).status_code == 200
        smtp.handler.wait_for(1, timeout=20)
        [message] = smtp.messages

    invoice = Invoice.objects.get()
    delivery = EmailDelivery.objects.get()
    assert delivery.key == f"invoice_email_sent:{invoice.pk}"
    assert (delivery.state, delivery.attempts) == ("sent", 1)
    assert message["To"] == "Ada Lovelace <ada@example.com>"
    assert message["From"] == "Billing <billing@example.com>"
    assert message["Subject"] == "Your invoice INV-42 is paid"
    assert message["Message-ID"] == delivery.message_id
    assert message["Message-ID"].startswith("<in_one.")
    assert message["Message-ID"].endswith("@example.com>")
    plain = message.get_body(("plain",)).get_content()  # type: ignore[union-attr]
    html = message.get_body(("html",)).get_content()  # type: ignore[union-attr]
    for part in (plain, html):
        assert "1,234.56 EUR" in part
        assert "INV-42" in part
        assert "https://invoice.stripe.com/i/acct_test/in_one" in part
    assert Job.objects.get().published_at is not None


def test_paid_and_payment_succeeded_each_delivered_twice_send_one_email(
    client: Client, smtp: SmtpServer
) -> None:
    paid = stripe_events.encode(paid_event("in_twice"))
    succeeded = stripe_events.encode(paid_event("in_twice", event_type="invoice.payment_succeeded"))
    with worker_thread():
        for body in (paid, succeeded, paid, succeeded):
            assert post_event(client, body).status_code == 200
        smtp.handler.wait_for(1, timeout=20)
        # Four events, one job; its message delivered twice more, as a broker's redelivery
        # would bring it.
        [job] = Job.objects.all()
        assert wait_until(lambda: Job.objects.get().status == "SUCCESSFUL", timeout=10)
        for _ in range(2):
            broker.job_message_again(job.pk, queue=job.queue)
        pipeline_quiet()
    assert len(smtp.messages) == 1
    assert EmailDelivery.objects.get().state == "sent"
    job.refresh_from_db()
    assert (job.status, job.attempts, job.return_value) == ("SUCCESSFUL", 1, "sent")


def test_smtp_451_twice_then_accepted_is_delivered_on_the_third_attempt(
    client: Client, smtp: SmtpServer
) -> None:
    smtp.handler.faults.replies = ["451 4.3.0 try again later", "451 4.3.0 try again later"]
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event()))
        smtp.handler.wait_for(1, timeout=30)
    assert smtp.handler.attempts == 3
    delivery = EmailDelivery.objects.get()
    assert (delivery.state, delivery.attempts) == ("sent", 3)
    assert not DeadLetter.objects.exists()


def test_smtp_550_is_dead_lettered_at_once(client: Client, smtp: SmtpServer) -> None:
    smtp.handler.faults.always = "550 5.7.1 message rejected"
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event()))
        assert wait_until(DeadLetter.objects.exists, timeout=20)
        pipeline_quiet()
    letter = DeadLetter.objects.get()
    invoice = Invoice.objects.get()
    assert smtp.handler.attempts == 1
    assert (letter.task, letter.args, letter.reason) == (
        send_invoice_email.module_path,
        [invoice.pk],
        "permanent",
    )
    assert letter.attempts == 1
    assert letter.exception_class == "asyncwork.errors.PermanentError"
    # In words, as the server said it; smtplib's own exception stays in the traceback.
    assert letter.exception_message == "SMTP 550 5.7.1 message rejected"
    assert "Traceback" in letter.traceback
    assert "SMTPDataError: (550, b'5.7.1 message rejected')" in letter.traceback
    delivery = EmailDelivery.objects.get()
    assert (delivery.state, delivery.last_error) == ("failed", "SMTP 550 5.7.1 message rejected")


def test_refused_recipient_is_dead_lettered_at_once(client: Client, smtp: SmtpServer) -> None:
    smtp.handler.faults.refuse = {"nobody@example.com"}
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event(customer_email="nobody@example.com")))
        assert wait_until(DeadLetter.objects.exists, timeout=20)
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    refusal = "recipient refused: 550 5.1.1 mailbox unavailable (nobody@example.com)"
    assert letter.exception_message == refusal
    assert EmailDelivery.objects.get().last_error == refusal


@pytest.mark.parametrize(
    ("email", "reason"),
    [
        ("", "invoice has no customer email"),
        ("not-an-address", "invalid recipient address"),
        ("a@example.com\nBcc: victim@example.com", "header injection"),
    ],
)
def test_bad_recipients_are_permanent_failures(
    client: Client, smtp: SmtpServer, email: str, reason: str
) -> None:
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event(customer_email=email)))
        assert wait_until(DeadLetter.objects.exists, timeout=20)
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert reason in letter.exception_message
    assert smtp.handler.attempts == 0


def test_a_missing_invoice_is_a_permanent_failure(smtp: SmtpServer) -> None:
    with worker_thread():
        result = send_invoice_email.enqueue(987654)
        assert wait_until(DeadLetter.objects.exists, timeout=20)
    letter = DeadLetter.objects.get()
    assert (letter.args, letter.reason, letter.attempts) == ([987654], "permanent", 1)
    assert "invoice 987654 does not exist" in letter.exception_message
    assert letter.task_id == message_id(int(result.id))
    failed = send_invoice_email.get_result(result.id)
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 1)
    assert [e.exception_class_path for e in failed.errors] == ["asyncwork.errors.PermanentError"]


@pytest.mark.slow
def test_smtp_unreachable_throughout_dead_letters_after_exactly_five_attempts(
    client: Client, smtp_unreachable: int
) -> None:
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event()))
        # Backoff 1, 2, 2, 2 s at most (base 1, cap 2 in the test settings), with jitter.
        assert wait_until(DeadLetter.objects.exists, timeout=30)
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("exhausted", 5)
    # Refused: the provider did not answer (what its breaker counts), a TransientError.
    assert letter.exception_class == "asyncwork.errors.Unreachable"
    assert letter.first_failed_at < letter.last_failed_at
    delivery = EmailDelivery.objects.get()
    assert (delivery.state, delivery.attempts) == ("failed", 5)
    job = Job.objects.get()
    assert (job.status, job.attempts) == ("FAILED", 5)
    assert [e["exception_class_path"] for e in job.errors] == ["asyncwork.errors.Unreachable"] * 5
