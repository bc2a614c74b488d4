"""What the invoicing app tells the dead-letter queue about its dead letters: the invoice
(number, where its emails go now, its admin page) for a payment email's and a resend's, read
in one query for a whole page; the failure as stored, on one line."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from asyncwork.deadletters import Subject, failure, refusals, subjects
from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery
from invoicing.services import invoice_recipient_correct
from invoicing.tasks import resend_invoice_email, send_invoice_email
from tests.helpers.factories import paid_invoice

pytestmark = pytest.mark.django_db

_task_ids = iter(range(1_000_000))
# What a dead letter of each email task holds: the task's module path (its describer and
# replay check are declared with the task itself, invoicing/deadletters.py).
SEND = send_invoice_email.module_path
RESEND = resend_invoice_email.module_path


def letter(task: str, args: Any, message: str = "", exception_class: str = "") -> DeadLetter:
    return DeadLetter.objects.create(
        task=task,
        task_id=f"t-{next(_task_ids)}",
        args=args,
        queue="email",
        reason="permanent",
        exception_class=exception_class or "asyncwork.errors.PermanentError",
        exception_message=message,
        attempts=1,
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )


def test_a_payment_emails_dead_letter_is_its_invoice_and_where_its_emails_go_now() -> None:
    invoice = paid_invoice(number="INV-7", customer_email="typo@exmaple.com")
    dead = letter(SEND, [invoice.pk])
    assert subjects([dead]) == {
        dead.pk: Subject(
            kind="invoice",
            label="INV-7",
            recipient="typo@exmaple.com",
            url=f"/admin/invoicing/invoice/{invoice.pk}/change/",
            outcome="no email attempted yet",
        )
    }
    invoice.recipient_override = "fixed@example.com"
    invoice.save()
    assert subjects([dead])[dead.pk].recipient == "fixed@example.com"


def test_a_resends_dead_letter_is_its_invoice_too() -> None:
    invoice = paid_invoice(number="INV-8")
    resend = EmailDelivery.objects.create(
        key=f"invoice_email_resend:{invoice.pk}:abc",
        invoice=invoice,
        state="failed",
        message_id="<x@example.com>",
    )
    dead = letter(RESEND, [resend.pk])
    subject = subjects([dead])[dead.pk]
    assert (subject.label, subject.recipient) == ("INV-8 (resend)", invoice.customer_email)
    assert subject.url == f"/admin/invoicing/invoice/{invoice.pk}/change/"


def test_a_page_of_dead_letters_is_described_in_one_query_per_kind_of_job() -> None:
    def queries(letters: list[DeadLetter]) -> int:
        with CaptureQueriesContext(connection) as captured:
            described = subjects(letters)
        assert set(described) == {x.pk for x in letters}
        return len(captured)

    def page(size: int) -> list[DeadLetter]:
        letters = []
        for _ in range(size):
            invoice = paid_invoice()
            resend = EmailDelivery.objects.create(
                key=f"invoice_email_resend:{invoice.pk}:x", invoice=invoice, state="failed"
            )
            letters.append(letter(SEND, [invoice.pk]))
            letters.append(letter(RESEND, [resend.pk]))
        return letters

    assert queries(page(1)) == 2
    assert queries(page(50)) == 2


def test_what_cannot_be_described_is_left_to_its_task_and_arguments() -> None:
    gone = letter(SEND, [987654])
    odd = [letter(SEND, args) for args in ([], ["12"], [True], {"a": 1})]
    other = letter("core.nothing", [1])
    assert subjects([gone, *odd, other]) == {}


@pytest.mark.parametrize(
    ("stored", "words"),
    [
        (
            "recipient refused: 550 5.1.1 mailbox unavailable (jenny@example.com)",
            "recipient refused: 550 5.1.1 mailbox unavailable (jenny@example.com)",
        ),
        ("invoice 42 does not exist", "invoice 42 does not exist"),
        ("circuit open; next try in\n30.0 s", "circuit open; next try in 30.0 s"),
    ],
)
def test_the_failure_is_the_stored_message_on_one_line(stored: str, words: str) -> None:
    assert failure(letter(SEND, [1], stored)) == words


def test_a_failure_with_no_message_is_named_by_its_class() -> None:
    dead = letter("core.nothing", [1], "", exception_class="celery.exceptions.Reject")
    assert failure(dead) == "Reject"


def test_what_became_of_the_email_is_read_with_the_invoice() -> None:
    invoice = paid_invoice()
    dead = letter(SEND, [invoice.pk])
    delivery = EmailDelivery.objects.create(
        key=f"invoice_email_sent:{invoice.pk}",
        invoice=invoice,
        state="failed",
        recipient=invoice.recipient,
        message_id="<x@example.com>",
    )
    assert subjects([dead])[dead.pk].outcome == (
        f"email not sent to {invoice.recipient}: its last attempt failed"
    )
    sent_at = timezone.now()
    EmailDelivery.objects.filter(pk=delivery.pk).update(state="sent", sent_at=sent_at)
    assert subjects([dead])[dead.pk].outcome == (
        f"email sent {sent_at:%Y-%m-%d %H:%M} UTC to {invoice.recipient}"
    )


def test_a_replay_of_an_address_failure_is_refused_until_the_address_changes() -> None:
    invoice = paid_invoice(customer_email="typo@exmaple.com")
    EmailDelivery.objects.create(
        key=f"invoice_email_sent:{invoice.pk}",
        invoice=invoice,
        state="failed",
        recipient="typo@exmaple.com",
    )
    on_address = letter(
        SEND,
        [invoice.pk],
        "recipient refused: 550 5.1.1 no such user (typo@exmaple.com)",
        exception_class="invoicing.mail.RecipientRejected",
    )
    elsewhere = letter(SEND, [invoice.pk], "SMTP 554 5.7.1 message rejected")
    assert refusals([on_address, elsewhere]) == {
        on_address.pk: "it failed on its recipient address (typo@exmaple.com), which is "
        "unchanged: correct the recipient first"
    }
    invoice_recipient_correct(
        invoice_id=invoice.pk, email="fixed@example.com", reason="typo", actor="test"
    )
    assert refusals([on_address, elsewhere]) == {}
    # Sent meanwhile (a resend, say), to the same address: a replay would do nothing; let it.
    invoice_recipient_correct(invoice_id=invoice.pk, email="", reason="back", actor="test")
    assert on_address.pk in refusals([on_address])
    EmailDelivery.objects.filter(invoice=invoice).update(state="sent", sent_at=timezone.now())
    assert refusals([on_address]) == {}
