"""What a signed event can put into the email, end to end: webhook -> job -> a real worker
-> a real SMTP server (aiosmtpd, with and without SMTPUTF8), reading what the server received.

International addresses are delivered (IDNA domain; a UTF-8 local part with SMTPUTF8, or a
dead letter saying why), control characters never reach a header, and only an https link to
an allowed host is put in the email."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from email.message import EmailMessage
from typing import Any

import pytest
from django.core.mail import EmailMultiAlternatives
from django.test import Client

from asyncwork.contrib import mail as contrib_mail
from asyncwork.errors import TransientError, Unreachable
from asyncwork.models import DeadLetter
from invoicing import tasks
from invoicing.models import EmailDelivery, Invoice
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.mail import use_smtp
from tests.helpers.processes import worker_thread
from tests.helpers.stripe import paid_event, post_event

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def smtp_utf8(settings: Any) -> Iterator[SmtpServer]:
    """A real SMTP server offering SMTPUTF8 (RFC 6531); Django's settings point at it."""
    server = SmtpServer(smtputf8=True).start()
    use_smtp(settings, server.port)
    yield server
    server.stop()


def deliver(client: Client, smtp: SmtpServer, *events: dict[str, Any]) -> list[EmailMessage]:
    """Post the events and let a real worker send them; what the server received."""
    with worker_thread():
        for event in events:
            assert post_event(client, stripe_events.encode(event)).status_code == 200
        wait_until(
            lambda: len(smtp.messages) + DeadLetter.objects.count() >= len(events), timeout=30
        )
    return smtp.messages


def plain_and_html(message: EmailMessage) -> tuple[str, str]:
    plain = message.get_body(("plain",))
    html = message.get_body(("html",))
    assert plain is not None
    assert html is not None
    return plain.get_content(), html.get_content()


# --- International addresses -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("email", "name", "envelope", "to"),
    [
        (
            "jenny@exämple.com",
            "Jenny",
            "jenny@xn--exmple-cua.com",
            "Jenny <jenny@xn--exmple-cua.com>",
        ),
        ("jenny@exämple.com", "", "jenny@xn--exmple-cua.com", "jenny@xn--exmple-cua.com"),
        # IDNA 2008, not Python's IDNA 2003 codec (which maps ß to ss: another domain).
        ("jenny@faß.de", "Jénny", "jenny@xn--fa-hia.de", "Jénny <jenny@xn--fa-hia.de>"),
    ],
)
def test_an_international_domain_is_delivered_in_its_idna_form(
    client: Client, smtp: SmtpServer, email: str, name: str, envelope: str, to: str
) -> None:
    [message] = deliver(client, smtp, paid_event(customer_email=email, customer_name=name))

    [received] = smtp.handler.envelopes
    assert received.rcpt_tos == [envelope]
    assert received.smtputf8 is False  # any server takes it
    assert str(message["To"]) == to
    assert EmailDelivery.objects.get().state == "sent"
    assert not DeadLetter.objects.exists()


def test_a_utf8_local_part_is_delivered_with_smtputf8_when_the_server_offers_it(
    client: Client, smtp_utf8: SmtpServer
) -> None:
    event = paid_event(customer_email="jénny@exämple.com", customer_name="Jénny Rosen")

    [message] = deliver(client, smtp_utf8, event)

    [received] = smtp_utf8.handler.envelopes
    assert received.smtputf8 is True
    assert received.rcpt_tos == ["jénny@exämple.com"]
    assert received.mail_from == "billing@example.com"
    [address] = message["To"].addresses
    assert (address.display_name, address.username, address.domain) == (
        "Jénny Rosen",
        "jénny",
        "exämple.com",
    )
    plain, _ = plain_and_html(message)
    assert "Hello Jénny Rosen," in plain
    assert EmailDelivery.objects.get().state == "sent"


def test_an_ascii_address_needs_no_smtputf8_even_when_offered(
    client: Client, smtp_utf8: SmtpServer
) -> None:
    deliver(client, smtp_utf8, paid_event(customer_email="ada@example.com", customer_name="Ådä"))
    [received] = smtp_utf8.handler.envelopes
    assert (received.smtputf8, received.rcpt_tos) == (False, ["ada@example.com"])
    assert str(smtp_utf8.messages[0]["To"]) == "Ådä <ada@example.com>"


def test_a_utf8_local_part_is_a_dead_letter_when_the_server_lacks_smtputf8(
    client: Client, smtp: SmtpServer
) -> None:
    deliver(client, smtp, paid_event(customer_email="jénny@example.com"))

    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert letter.exception_class == "asyncwork.contrib.mail.RecipientRejected"
    assert "the mail server cannot take this address" in letter.exception_message
    assert "does not offer SMTPUTF8, which the address 'jénny@example.com' needs" in (
        letter.exception_message
    )
    assert smtp.handler.attempts == 0  # refused before MAIL FROM: nothing was sent
    assert EmailDelivery.objects.get().state == "failed"


# --- Control characters ----------------------------------------------------------------------

# Python's email package breaks a header line on every one of these, not only on CR and LF.
LINE_BREAKERS = "\v\f\x1c\x1d\x1e\x85\u2028\u2029"


def test_control_characters_in_names_and_numbers_never_reach_a_header(
    client: Client, smtp: SmtpServer
) -> None:
    event = paid_event(
        customer_email="jenny@example.com",
        customer_name="Jenny\vRosen\x1cBcc: victim@evil.example\x1e\x07",
        number="INV-42\x1dX-Injected: yes\u2028\x85\f",
    )
    # NUL arrives as the JSON escape \u0000 (stored without it) and C1 controls as themselves.
    event["data"]["object"]["customer_name"] += "\x00\x9b" + LINE_BREAKERS

    [message] = deliver(client, smtp, event)

    assert message.defects == []
    assert sorted(message.keys()) == sorted(
        ["Content-Type", "MIME-Version", "Subject", "From", "To", "Date", "Message-ID"]
    )
    assert message["Subject"] == "Your invoice INV-42 X-Injected: yes is paid"
    [address] = message["To"].addresses
    assert address.display_name == "Jenny Rosen Bcc: victim@evil.example"
    assert address.addr_spec == "jenny@example.com"
    assert smtp.handler.envelopes[0].rcpt_tos == ["jenny@example.com"]
    plain, html = plain_and_html(message)
    assert "Hello Jenny Rosen Bcc: victim@evil.example," in plain
    assert "INV-42 X-Injected: yes" in plain
    assert "INV-42 X-Injected: yes" in html


@pytest.mark.parametrize("breaker", ["\n", "\r", "\v", "\x1c", "\u2028"])
def test_a_line_break_in_the_address_stays_a_permanent_error(
    client: Client, smtp: SmtpServer, breaker: str
) -> None:
    # Unlike a name, an address cannot be repaired: which one was meant?
    deliver(client, smtp, paid_event(customer_email=f"a@example.com{breaker}Bcc: v@evil.example"))
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert "header injection in customer email" in letter.exception_message
    assert smtp.handler.attempts == 0


def test_unencodable_text_in_the_address_is_a_dead_letter_not_a_crash(
    client: Client, smtp: SmtpServer
) -> None:
    event = paid_event()
    event["data"]["object"]["customer_email"] = "jen\ud800ny@example.com"
    with worker_thread():
        body = stripe_events.encode(event)
        assert post_event(client, body).status_code == 200
        assert wait_until(DeadLetter.objects.exists, timeout=30)
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.attempts) == ("permanent", 1)
    assert "it held unencodable text" in letter.exception_message


# --- The hosted invoice URL ------------------------------------------------------------------

REFUSED_URLS = {
    "javascript:alert(document.cookie)": "not https",
    "http://invoice.stripe.com/i/acct_1/in_1": "not https",
    "https://evil.example/i/acct_1/in_1": "host 'evil.example' is not in INVOICE_URL_ALLOWED_HOSTS",
    "https://invoice.stripe.com@evil.example/": "carries user info",
    "https://invoice.stripe.com.evil.example/i": (
        "host 'invoice.stripe.com.evil.example' is not in INVOICE_URL_ALLOWED_HOSTS"
    ),
    "https://evil.example\\@invoice.stripe.com/": (
        "not printable ASCII, or contains a backslash or space"
    ),
    "https://invoice.stripe.com:8443/i/acct_1/in_1": "has a port other than 443",
    "https://invoice.stripe.com/i/\u202eevil": (
        "not printable ASCII, or contains a backslash or space"
    ),
    "data:text/html,<script>alert(1)</script>": "not https",
}


def test_only_an_https_link_to_an_allowed_host_is_put_in_the_email(
    client: Client, smtp: SmtpServer, caplog: pytest.LogCaptureFixture
) -> None:
    good = "https://invoice.stripe.com/i/acct_1/in_good?s=ap"
    urls = [good, *REFUSED_URLS]
    events = []
    for i, url in enumerate(urls):
        event = paid_event(f"in_url{i:02d}", customer_email=f"url{i}@example.com")
        event["data"]["object"]["hosted_invoice_url"] = url
        events.append(event)

    # On the module's logger itself: the worker's start re-applies settings.LOGGING (Celery's
    # Django fixup calls django.setup()), which replaces the root logger's handlers, caplog's too.
    logger = logging.getLogger("invoicing.tasks")
    logger.addHandler(caplog.handler)
    try:
        messages = deliver(client, smtp, *events)
    finally:
        logger.removeHandler(caplog.handler)

    assert len(messages) == len(urls)
    by_recipient = {message["To"].addresses[0].username: message for message in messages}
    for i, url in enumerate(urls):
        plain, html = plain_and_html(by_recipient[f"url{i}"])
        if url == good:
            assert f"View or download the invoice: {good}" in plain
            assert f'<a href="{good.replace("&", "&amp;")}">' in html
        else:
            for part in (plain, html):
                assert "View or download the invoice" not in part
                assert "evil" not in part
                assert "script" not in part
    # invoice_id: a field the log context puts on each record (asyncwork.logging).
    warnings = {
        r.invoice_id: r  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "invoicing.tasks" and r.levelno >= logging.WARNING
    }
    invoices = dict(Invoice.objects.values_list("provider_invoice_id", "pk"))
    assert sorted(warnings) == sorted(invoices[f"in_url{i:02d}"] for i in range(1, len(urls)))
    for i, (url, reason) in enumerate(REFUSED_URLS.items(), start=1):
        record = warnings[invoices[f"in_url{i:02d}"]]
        assert record.levelname == "WARNING"
        assert record.getMessage() == f"hosted invoice URL left out of the email: {reason}"
        assert url not in record.getMessage()
    assert not DeadLetter.objects.exists()


def test_the_allowed_hosts_are_a_setting(settings: Any) -> None:
    settings.INVOICE_URL_ALLOWED_HOSTS = ["billing.example.com"]
    invoice = Invoice(pk=1, hosted_invoice_url="https://billing.example.com/i/1")
    assert tasks.invoice_url(invoice) == "https://billing.example.com/i/1"
    invoice.hosted_invoice_url = "https://invoice.stripe.com/i/1"
    assert tasks.invoice_url(invoice) == ""
    settings.INVOICE_URL_ALLOWED_HOSTS = []
    invoice.hosted_invoice_url = "https://billing.example.com/i/1"
    assert tasks.invoice_url(invoice) == ""


# --- The failure in words ---------------------------------------------------------------------


def test_a_multi_line_refusal_is_one_line_of_words_on_the_dead_letter(
    client: Client, smtp: SmtpServer
) -> None:
    smtp.handler.faults.always = "554-5.7.1 message refused:\r\n554 5.7.1 policy (see example.org)"
    deliver(client, smtp, paid_event())

    letter = DeadLetter.objects.get()
    assert letter.exception_message == (
        "SMTP 554 5.7.1 message refused: 5.7.1 policy (see example.org)"
    )
    assert (letter.reason, letter.attempts) == ("permanent", 1)


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (b"5.1.1 mailbox unavailable", "550 5.1.1 mailbox unavailable"),
        # smtplib joins the lines of a multi-line reply with a newline.
        (b"5.7.1 first\n5.7.1 second", "550 5.7.1 first 5.7.1 second"),
        # Not UTF-8, a NUL (PostgreSQL refuses it in text), an escape sequence for a terminal.
        (b"5.1.1 bo\xeete\x00 \x1b[31mred", "550 5.1.1 bo\ufffdte [31mred"),
        ("5.1.1 déjà vu", "550 5.1.1 déjà vu"),
    ],
)
def test_an_smtp_reply_in_words_is_one_line_of_storable_text(
    reply: bytes | str, words: str
) -> None:
    assert contrib_mail.smtp_reply_text(550, reply) == words


# --- The SMTP connection kept across messages --------------------------------------------------


def plain_message(number: int) -> EmailMultiAlternatives:
    return EmailMultiAlternatives(
        subject=f"Invoice {number}",
        body="Paid, thank you.",
        from_email="billing@example.com",
        to=[f"customer{number}@example.com"],
        headers={"Message-ID": f"<kept.{number}@example.com>"},
    )


def received_ids(server: SmtpServer) -> list[str]:
    return [received.message_id for received in server.handler.received()]


def test_messages_share_one_connection_up_to_its_bound(
    monkeypatch: pytest.MonkeyPatch, smtp: SmtpServer
) -> None:
    monkeypatch.setattr(contrib_mail, "CONNECTION_MAX_MESSAGES", 3)
    for number in range(5):
        contrib_mail.deliver(plain_message(number))

    assert received_ids(smtp) == [f"<kept.{n}@example.com>" for n in range(5)]
    assert smtp.handler.counts["sessions"] == 2  # 3 messages, then a new connection for 2
    # Each message ended with RSET: none of them is left looking cut in the server's record.
    assert set(smtp.handler.endings.values()) == {"rset"}


def test_a_connection_the_server_dropped_is_replaced_without_a_loss_or_a_duplicate(
    settings: Any,
) -> None:
    first = SmtpServer().start()
    use_smtp(settings, first.port)
    try:
        contrib_mail.deliver(plain_message(1))
    finally:
        first.stop()  # the kept connection is closed by the server
    second = SmtpServer(port=first.port).start()
    try:
        contrib_mail.deliver(plain_message(2))
        contrib_mail.deliver(plain_message(3))
    finally:
        second.stop()

    assert received_ids(first) == ["<kept.1@example.com>"]
    assert received_ids(second) == ["<kept.2@example.com>", "<kept.3@example.com>"]
    assert second.handler.counts["sessions"] == 1


def test_a_failed_message_closes_the_connection_and_the_next_opens_a_new_one(
    smtp: SmtpServer,
) -> None:
    smtp.handler.faults.replies.append("451 4.3.0 try again later")
    with pytest.raises(TransientError):
        contrib_mail.deliver(plain_message(1))
    contrib_mail.deliver(plain_message(1))
    contrib_mail.deliver(plain_message(2))

    assert received_ids(smtp) == ["<kept.1@example.com>", "<kept.2@example.com>"]
    assert smtp.handler.counts["sessions"] == 2


@pytest.mark.parametrize(
    ("reply", "unreachable"),
    [("451 4.3.0 try again later", False), ("421 4.3.2 service not available", True)],
)
def test_only_a_server_not_answering_is_unreachable(
    smtp: SmtpServer, reply: str, unreachable: bool
) -> None:
    """What the provider's breaker counts: a 421 (the service is not available) is the server
    gone; a 451 defers this one message, from a server that answers."""
    smtp.handler.faults.replies.append(reply)
    with pytest.raises(TransientError) as raised:
        contrib_mail.deliver(plain_message(1))
    assert isinstance(raised.value, Unreachable) is unreachable
    smtp.stop()
    with pytest.raises(Unreachable):  # nobody listening: refused
        contrib_mail.deliver(plain_message(2))


def test_a_changed_setting_opens_a_connection_to_the_new_server(
    settings: Any, smtp: SmtpServer
) -> None:
    contrib_mail.deliver(plain_message(1))
    with SmtpServer() as other:
        use_smtp(settings, other.port)
        contrib_mail.deliver(plain_message(2))
        assert received_ids(other) == ["<kept.2@example.com>"]
    assert received_ids(smtp) == ["<kept.1@example.com>"]
