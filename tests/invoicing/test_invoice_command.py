"""``manage.py invoice show|recipient INVOICE``: an invoice found by its id, provider's id or
number (one that names none or several is refused with the candidates); ``show`` says where its
emails go and each email's and dead letter's state; ``recipient`` is the admin's correction,
recorded as ``cli:<actor>``; ``open`` makes an open invoice that the events of the kit's
``python -m stack.stripe_trigger`` then act on; bad input is one line and exit status 1 (2 for
argparse's own), with nothing changed."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import send_invoice_email
from stack.smtp import SmtpServer
from tests.helpers.deadletters import refused_invoice_dead_letter
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import python, worker_thread
from tests.helpers.quiescence import pipeline_quiet
from webhooks import stripe as webhook_events
from webhooks.stripe import Event, webhook_handler

pytestmark = pytest.mark.django_db(transaction=True)  # the subprocesses read what we wrote


def invoice(*args: str) -> str:
    out = StringIO()
    call_command("invoice", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    """A real ``python manage.py <args>`` on this test's database."""
    return python("manage.py", *args)


def unchanged(made: Invoice) -> None:
    stored = Invoice.objects.get(pk=made.pk)
    assert (stored.recipient_override, stored.updated_at) == (
        made.recipient_override,
        made.updated_at,
    )
    assert not OperatorAction.objects.exists()


def test_an_invoice_is_named_by_its_id_provider_id_or_number() -> None:
    made = paid_invoice("in_cmd_1", number="INV-0001")
    for name in (str(made.pk), "in_cmd_1", "INV-0001", " INV-0001 "):
        assert invoice("show", name).startswith(f"Invoice INV-0001 (id {made.pk}, "), name


def test_a_name_for_no_invoice_or_several_is_refused_with_the_candidates() -> None:
    with pytest.raises(CommandError, match="no invoice has the id, provider's id or number 'x'"):
        invoice("show", "x")
    with pytest.raises(CommandError, match="no invoice has the id"):
        invoice("show", "99999999999999999999999")  # beyond any id: none, not an error
    first = paid_invoice("in_cmd_2", number="INV-7")
    second = paid_invoice("in_cmd_3", number="INV-7")  # numbers are the provider's: not unique
    with pytest.raises(CommandError) as refused:
        invoice("recipient", "INV-7", "--email", "a@example.com", "--why", "typo")
    assert str(refused.value) == (
        f"'INV-7' names more than one invoice: id {first.pk} (provider's id in_cmd_2, number "
        f"INV-7); id {second.pk} (provider's id in_cmd_3, number INV-7); give its id"
    )
    # One invoice's number may be another's id.
    numbered = paid_invoice("in_cmd_4", number=str(first.pk))
    with pytest.raises(CommandError, match=f"names more than one invoice: id {first.pk} "):
        invoice("show", str(first.pk))
    assert f"(id {numbered.pk}," in invoice("show", "in_cmd_4")
    unchanged(first)


def test_show_says_where_the_emails_go_and_each_emails_state() -> None:
    made = paid_invoice("in_cmd_5", number="INV-5", customer_email="typo@exmaple.com")
    assert invoice("show", "INV-5").splitlines() == [
        f"Invoice INV-5 (id {made.pk}, provider's id in_cmd_5)",
        "  Status:              paid, 1.00 USD",
        "  Provider's address:  typo@exmaple.com",
        "  Correction:          -",
        "  Emails go to:        typo@exmaple.com",
        "Emails: none",
        "Dead letters: none",
    ]
    failed = EmailDelivery.objects.create(
        key=f"invoice_email_sent:{made.pk}",
        invoice=made,
        state="failed",
        attempts=1,
        message_id="<a@example.com>",
        last_error="recipient refused:\n550 no such user",
    )
    sent = EmailDelivery.objects.create(
        key=f"invoice_email_resend:{made.pk}:abc",
        invoice=made,
        state="sent",
        attempts=2,
        message_id="<b@example.com>",
        requested_by="api:op",
        sent_at=timezone.now(),
    )
    letter = DeadLetter.objects.create(
        task=send_invoice_email.module_path,
        task_id="t1",
        args=[made.pk],
        queue="email",
        reason="permanent",
        attempts=1,
        exception_message="recipient refused: 550 no such user",
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )
    shown = invoice("show", str(made.pk)).splitlines()
    assert shown[5:] == [
        "Emails: 2",
        f"  {failed.pk}, failed, 1 attempt(s), key invoice_email_sent:{made.pk}, "
        "last error: recipient refused: 550 no such user",
        f"  {sent.pk}, sent, at {timezone.localtime(sent.sent_at):%Y-%m-%d %H:%M %Z}, "
        f"2 attempt(s), key invoice_email_resend:{made.pk}:abc, requested by api:op",
        "Dead letters: 1",
        f"  {letter.pk}, waiting: recipient refused: 550 no such user",
    ]


def test_show_prints_stored_control_characters_escaped() -> None:
    """The provider's address is the provider's text: a line break or an escape sequence in it
    is shown, not obeyed by the terminal."""
    made = paid_invoice(customer_email="a@example.com\r\nBcc: \x1b[2Jb@example.com")
    shown = invoice("show", str(made.pk))
    assert "\x1b" not in shown
    assert "  Provider's address:  'a@example.com\\r\\nBcc: \\x1b[2Jb@example.com'" in shown


def test_a_correction_is_made_recorded_and_a_repeat_changes_nothing() -> None:
    made = paid_invoice("in_cmd_6", number="INV-6", customer_email="typo@exmaple.com")
    out = invoice(
        "recipient",
        "INV-6",
        "--email",
        " right@example.com ",
        "--why",
        "ticket 7",
        "--actor",
        "jane",
    )
    assert out.splitlines() == [
        "Invoice INV-6: emails now go to right@example.com.",
        "Nothing was sent; no dead letter of it waits.",
    ]
    made.refresh_from_db()
    assert (made.customer_email, made.recipient_override) == (
        "typo@exmaple.com",
        "right@example.com",
    )
    recorded = OperatorAction.objects.get()
    assert (recorded.action, recorded.actor, recorded.target, recorded.detail) == (
        "invoice.recipient_correct",
        "cli:jane",
        made,
        "ticket 7",
    )
    assert recorded.before == {"recipient_override": "", "recipient": "typo@exmaple.com"}
    assert recorded.after == {
        "recipient_override": "right@example.com",
        "recipient": "right@example.com",
    }
    assert "  Correction:          right@example.com" in invoice("show", "INV-6")

    again = invoice("recipient", "INV-6", "--email", "right@example.com", "--why", "ticket 7")
    assert again == "Invoice INV-6: nothing changed: the recipient is already right@example.com\n"
    assert OperatorAction.objects.count() == 1

    cleared = invoice("recipient", "in_cmd_6", "--clear", "--why", "fixed at Stripe")
    assert cleared.splitlines()[0] == (
        "Invoice INV-6: emails now go to typo@exmaple.com (the provider's address)."
    )
    made.refresh_from_db()
    assert made.recipient_override == ""
    latest = OperatorAction.objects.latest("pk")
    assert (latest.before, latest.after) == (recorded.after, recorded.before)
    assert invoice("recipient", "INV-6", "--clear", "--why", "again") == (
        "Invoice INV-6: nothing changed: there is no correction to remove\n"
    )
    assert OperatorAction.objects.count() == 2


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--email", "not an address", "--why", "typo"],
            "'not an address' is not a valid email address: invalid recipient address "
            "'not an address': An email address must have an @-sign.",
        ),
        (
            ["--email", "a@example.com\nBcc: b@example.com", "--why", "typo"],
            "'a@example.com\\nBcc: b@example.com' is not a valid email address: header injection "
            "in customer email: a line break or control character in it",
        ),
        (["--email", "right@example.com", "--why", "  "], "say why the recipient is corrected"),
        (["--email", " ", "--why", "typo"], "--email is empty: give the address, or --clear"),
        (["--email", "right@example.com"], "the following arguments are required: --why"),
        (
            ["--email", "right@example.com", "--clear", "--why", "typo"],
            "argument --clear: not allowed with argument --email",
        ),
        (["--why", "typo"], "one of the arguments --email --clear is required"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(args: list[str], error: str) -> None:
    made = paid_invoice()
    with pytest.raises(CommandError) as refused:
        invoice("recipient", str(made.pk), *args)
    assert str(refused.value).endswith(error)
    unchanged(made)


def test_bad_input_exits_non_zero_with_one_line_and_no_traceback() -> None:
    made = paid_invoice()
    bad_address = manage("invoice", "recipient", str(made.pk), "--email", "x@", "--why", "typo")
    assert bad_address.returncode == 1
    assert bad_address.stdout == ""
    assert bad_address.stderr.splitlines() == [
        "CommandError: 'x@' is not a valid email address: invalid recipient address 'x@': "
        "There must be something after the @-sign."
    ]
    unknown = manage("invoice", "show", "in_nope")
    assert unknown.returncode == 1
    assert unknown.stderr.splitlines() == [
        "CommandError: no invoice has the id, provider's id or number 'in_nope'"
    ]
    no_reason = manage("invoice", "recipient", str(made.pk), "--email", "a@example.com")
    assert no_reason.returncode == 2  # argparse's status for a missing argument
    assert "the following arguments are required: --why" in no_reason.stderr
    for result in (bad_address, unknown, no_reason):
        assert "Traceback" not in result.stderr
    unchanged(made)

    done = manage("invoice", "recipient", str(made.pk), "--email", "a@example.com", "--why", "typo")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Invoice {made}: emails now go to a@example.com.\n")
    assert OperatorAction.objects.get().actor.startswith("cli:")


def test_a_refused_address_fixed_and_replayed_from_a_terminal(
    client: Client, smtp: SmtpServer
) -> None:
    """The operator's path with commands alone: show, correct, replay, show."""
    with worker_thread():
        paid, letter = refused_invoice_dead_letter(client, smtp)
        before = invoice("show", paid.provider_invoice_id)
        assert "  Emails go to:        typo@exmaple.com" in before
        assert f"  {letter.pk}, waiting: " in before
        fixed = invoice(
            "recipient",
            str(paid.pk),
            "--email",
            "fixed@example.com",
            "--why",
            "typo",
            "--actor",
            "jane",
        )
        assert fixed.splitlines()[1] == (
            f"Nothing was sent: replay its dead letter with manage.py dlq replay {letter.pk}"
        )
        call_command("dlq", "replay", str(letter.pk), "--actor", "jane", stdout=StringIO())
        smtp.handler.wait_for(1, timeout=20)
        pipeline_quiet()

    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <fixed@example.com>"]
    after = invoice("show", str(paid.pk))
    assert "  Emails go to:        fixed@example.com" in after
    assert ", sent, at " in after
    assert f"  {letter.pk}, replayed by cli:jane at " in after
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.action, a.actor) for a in recorded] == [
        ("invoice.recipient_correct", "cli:jane"),
        ("dead_letter.replay", "cli:jane"),
    ]


@pytest.fixture
def void_handler() -> Iterator[None]:
    """The add-an-event-type how-to's ``invoice.voided`` handler, taken away after the test."""

    def parse(obj: Any) -> str:
        return str(obj["id"])

    @webhook_handler("invoice.voided", parse=parse)
    def apply(provider_invoice_id: str, event: Event) -> None:
        invoice = (
            Invoice.objects.select_for_update().filter(provider_invoice_id=provider_invoice_id)
        ).first()
        if invoice is None or event.created < invoice.provider_updated_at:
            return
        if invoice.status == Invoice.Status.PAID:
            return
        invoice.status = Invoice.Status.VOID
        invoice.provider_updated_at = event.created
        invoice.save(update_fields=["status", "provider_updated_at", "updated_at"])

    try:
        yield
    finally:
        webhook_events._handlers.pop("invoice.voided")


def test_open_makes_an_open_invoice_that_a_triggered_event_acts_on(
    live_server: Any, void_handler: None
) -> None:
    made = manage("invoice", "open", "--customer-email", "a@example.com", "--amount", "12.34")
    assert made.returncode == 0, made.stderr
    printed = re.fullmatch(
        r"Invoice open: id (\d+), provider's id (in_[0-9a-f]{24}), 12\.34 USD to a@example\.com\n",
        made.stdout,
    )
    assert printed, made.stdout
    opened = Invoice.objects.get()
    assert (str(opened.pk), opened.provider_invoice_id) == printed.groups()
    assert (opened.status, opened.amount_paid, opened.currency) == ("open", 1234, "usd")
    assert opened.provider_updated_at.microsecond == 0  # a Stripe event's resolution

    # At once, in the same second: the event is not older than the invoice.
    triggered = python(
        "-m",
        "stack.stripe_trigger",
        "invoice.voided",
        "--invoice-id",
        opened.provider_invoice_id,
        "--url",
        f"{live_server.url}/webhooks/stripe/",
    )
    assert triggered.returncode == 0, triggered.stderr
    assert '"type": "invoice.voided"' in triggered.stdout
    assert '"handled": true' in triggered.stdout
    assert Invoice.objects.get().status == Invoice.Status.VOID


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--customer-email", "x@", "--amount", "1"],
            "CommandError: 'x@' is not a valid email address: invalid recipient address 'x@': "
            "There must be something after the @-sign.",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "12.345"],
            "CommandError: '12.345' has more than 2 decimal(s), as USD has",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "ten"],
            "CommandError: 'ten' is not an amount (e.g. 12.34)",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "-1"],
            "CommandError: '-1' is not an amount (e.g. 12.34)",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "1.5", "--currency", "jpy"],
            "CommandError: '1.5' has more than 0 decimal(s), as JPY has",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "1", "--currency", "euro"],
            "CommandError: 'euro' is not a 3-letter currency code",
        ),
        (
            ["--customer-email", "a@example.com", "--amount", "1", "--invoice-id", "cus_1"],
            "CommandError: --invoice-id 'cus_1' is not an in_... id",
        ),
    ],
    ids=["address", "decimals", "words", "negative", "yen-decimals", "currency", "not-in"],
)
def test_open_refuses_bad_input_in_one_line_and_makes_nothing(args: list[str], error: str) -> None:
    """In this process: a CommandError is what ``manage.py`` prints as its one line with exit
    status 1, as a real process shows for ``open`` below (and for ``recipient`` and ``show``
    above)."""
    out = StringIO()
    with pytest.raises(CommandError) as refused:
        call_command("invoice", "open", *args, stdout=out, stderr=StringIO())
    assert (out.getvalue(), f"CommandError: {refused.value}".splitlines()) == ("", [error])
    assert not Invoice.objects.exists()


def test_open_takes_the_id_given_once() -> None:
    args = ["--customer-email", "a@example.com", "--amount", "5", "--invoice-id", "in_void_example"]
    made = manage("invoice", "open", *args)
    assert made.returncode == 0, made.stderr
    opened = Invoice.objects.get(provider_invoice_id="in_void_example")
    assert made.stdout == (
        f"Invoice open: id {opened.pk}, provider's id in_void_example, 5.00 USD to a@example.com\n"
    )
    again = manage("invoice", "open", *args)
    assert again.returncode == 1
    assert again.stderr.splitlines() == [
        f"CommandError: invoice in_void_example exists already (id {opened.pk})"
    ]
    assert Invoice.objects.count() == 1
