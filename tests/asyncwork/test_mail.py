"""``asyncwork.contrib.mail.EmailBackend`` against a real SMTP server (aiosmtpd) with and without
SMTPUTF8: an address with a UTF-8 local part goes out as written, with SMTPUTF8, or not at all;
every other message takes Django's own path."""

from __future__ import annotations

import re
import smtplib
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.mail import EmailMultiAlternatives, get_connection

from asyncwork.contrib.mail import address_spec, needs_smtputf8
from stack.smtp import SmtpServer

# Longer than a header line (78): the header is refolded on the way out.
LONG_NAME = "Jénny Ö. Rösen-Ünterberger, Geschäftsführerin der Beispielgesellschaft für Übungen"


@pytest.fixture
def server_utf8() -> Iterator[SmtpServer]:
    server = SmtpServer(smtputf8=True).start()
    yield server
    server.stop()


@pytest.fixture
def server_ascii() -> Iterator[SmtpServer]:
    server = SmtpServer().start()
    yield server
    server.stop()


def send(server: SmtpServer, message: EmailMultiAlternatives, **options: Any) -> int:
    connection = get_connection(
        "asyncwork.contrib.mail.EmailBackend",
        host="127.0.0.1",
        port=server.port,
        timeout=10,
        **options,
    )
    return connection.send_messages([message])


def message(**fields: object) -> EmailMultiAlternatives:
    defaults: dict[str, object] = {
        "subject": "Grüße",
        "body": "Hallo Jénny, schöne Grüße.\n",
        "from_email": "Billing <billing@example.com>",
        "to": ["jenny@example.com"],
    }
    built = EmailMultiAlternatives(**{**defaults, **fields})  # type: ignore[arg-type]
    built.attach_alternative("<p>Hallo Jénny</p>", "text/html")
    return built


def test_addresses_are_read_from_their_display_form() -> None:
    assert address_spec('"Rosen, Jénny" <jénny@exämple.com>') == "jénny@exämple.com"
    assert needs_smtputf8("Jénny <jénny@example.com>")
    assert not needs_smtputf8("Jénny <jenny@example.com>")  # only the name is not ASCII
    assert not needs_smtputf8("jenny@xn--exmple-cua.com")
    with pytest.raises(ValueError, match="invalid address"):
        address_spec("a@example.com, b@example.com")


def test_utf8_addresses_go_out_as_written_with_smtputf8(server_utf8: SmtpServer) -> None:
    sent = message(
        to=[f'"{LONG_NAME}" <jénny@exämple.com>'],
        cc=["Zoë <zoë@example.com>"],
        bcc=["archiv@example.com"],
        reply_to=["Büro <büro@example.com>"],
    )
    assert send(server_utf8, sent) == 1

    [received] = server_utf8.handler.envelopes
    assert received.smtputf8 is True
    assert received.mail_from == "billing@example.com"
    assert received.rcpt_tos == ["jénny@exämple.com", "zoë@example.com", "archiv@example.com"]
    [got] = server_utf8.messages
    assert [(a.display_name, a.addr_spec) for a in got["To"].addresses] == [
        (LONG_NAME, "jénny@exämple.com")
    ]
    assert got["Cc"].addresses[0].addr_spec == "zoë@example.com"
    assert got["Reply-To"].addresses[0].addr_spec == "büro@example.com"
    assert got["Bcc"] is None
    assert got["Subject"] == "Grüße"
    plain = got.get_body(("plain",))
    html = got.get_body(("html",))
    assert plain is not None
    assert html is not None
    # CRLF on the wire, as SMTP has it.
    assert plain.get_content() == "Hallo Jénny, schöne Grüße.\r\n"
    assert html.get_content() == "<p>Hallo Jénny</p>"


def test_a_utf8_address_is_not_sent_to_a_server_without_smtputf8(
    server_ascii: SmtpServer,
) -> None:
    with pytest.raises(smtplib.SMTPNotSupportedError, match=re.escape("'jénny@example.com' needs")):
        send(server_ascii, message(to=["Jenny <jénny@example.com>"]))
    assert server_ascii.handler.attempts == 0
    # Django's fail_silently is honoured: nothing sent, nothing raised.
    assert send(server_ascii, message(to=["jénny@example.com"]), fail_silently=True) == 0
    assert server_ascii.messages == []


def test_ascii_addresses_take_djangos_path_unchanged(server_ascii: SmtpServer) -> None:
    assert send(server_ascii, message(to=["Jénny Rösen <jenny@xn--exmple-cua.com>"])) == 1
    [received] = server_ascii.handler.envelopes
    assert (received.smtputf8, received.rcpt_tos) == (False, ["jenny@xn--exmple-cua.com"])
    [got] = server_ascii.messages
    [address] = got["To"].addresses
    assert (address.display_name, address.addr_spec) == ("Jénny Rösen", "jenny@xn--exmple-cua.com")
    # The name went as an RFC 2047 encoded word: the header section is ASCII.
    head = received.content.partition(b"\r\n\r\n")[0]
    assert head.isascii()
    assert b"=?utf-8?" in head
