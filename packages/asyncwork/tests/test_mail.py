"""``asyncwork.contrib.mail``: what each answer of a real SMTP server (aiosmtpd) becomes, and
what each of django-anymail's failures becomes, with no application around it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from aiosmtpd.controller import Controller
from anymail.exceptions import AnymailAPIError, AnymailRecipientsRefused
from django.core.mail import EmailMultiAlternatives

from asyncwork.contrib import mail
from asyncwork.errors import PermanentError, TransientError, Unreachable


class Answers:
    """Accepts everything but the mailboxes named after the reply they get."""

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: Any
    ) -> str:
        replies = {"deferred": "450 4.2.0 try again later", "gone": "550 5.1.1 no such user"}
        reply = replies.get(address.partition("@")[0])
        if reply:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if b"Subject: full" in envelope.content:
            return "452 4.3.1 insufficient storage"
        if b"Subject: spam" in envelope.content:
            return "554 5.7.1 message refused"
        return "250 OK"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def use_smtp(settings: Any, port: int) -> None:
    settings.EMAIL_BACKEND = "asyncwork.contrib.mail.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", port, 5


@pytest.fixture
def smtp(settings: Any) -> Iterator[None]:
    port = free_port()
    controller = Controller(Answers(), hostname="127.0.0.1", port=port)
    controller.start()
    use_smtp(settings, port)
    try:
        yield
    finally:
        mail.smtp_connection_close()
        controller.stop()


def message(to: str, subject: str = "hello") -> EmailMultiAlternatives:
    return EmailMultiAlternatives(subject, "body", "shop@example.com", [to])


def test_an_accepted_message_has_no_provider_id(smtp: None) -> None:
    assert mail.deliver(message("ada@example.com")) == ""
    assert mail.deliver(message("ada@example.com")) == ""  # over the kept connection


@pytest.mark.parametrize(
    ("to", "subject", "raised", "words"),
    [
        ("deferred@example.com", "hello", TransientError, "recipient deferred: 450 4.2.0"),
        ("gone@example.com", "hello", mail.RecipientRejected, "recipient refused: 550 5.1.1"),
        ("ada@example.com", "full", TransientError, "SMTP 452 4.3.1 insufficient storage"),
        ("ada@example.com", "spam", PermanentError, "SMTP 554 5.7.1 message refused"),
    ],
)
def test_each_smtp_answer_is_sorted_in_the_servers_words(
    smtp: None, to: str, subject: str, raised: type[Exception], words: str
) -> None:
    with pytest.raises(raised, match=words) as failed:
        mail.deliver(message(to, subject))
    assert not isinstance(failed.value, Unreachable)
    assert mail.deliver(message("ada@example.com")) == ""  # the next message goes through


def test_no_server_is_unreachable(settings: Any) -> None:
    use_smtp(settings, free_port())  # nothing listens on it
    with pytest.raises(Unreachable, match=r"SMTP (unavailable|unreachable)"):
        mail.deliver(message("ada@example.com"))


def answer(status: int, body: bytes, **headers: str) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response._content = body
    response.headers.update(headers)
    return response


@pytest.mark.parametrize(
    ("status", "body", "headers", "raised", "words"),
    [
        (503, b'{"Message": "down for maintenance"}', {}, Unreachable, "503: down for"),
        (429, b'{"message": "slow down"}', {"Retry-After": "7"}, TransientError, "rate limit"),
        (401, b'{"Message": "bad token"}', {}, PermanentError, "refused the message"),
    ],
)
def test_a_providers_answer_is_sorted_in_its_words(
    status: int, body: bytes, headers: dict[str, str], raised: type[Exception], words: str
) -> None:
    failure = AnymailAPIError(
        "failed", status_code=status, response=answer(status, body, **headers), esp_name="Postmark"
    )
    sorted_ = mail._provider_failure(failure)
    assert type(sorted_) is raised
    assert words in str(sorted_)
    if status == 429:
        assert isinstance(sorted_, TransientError)
        assert sorted_.retry_after == 7.0


def test_a_refused_recipient_is_the_recipients_failure() -> None:
    sorted_ = mail._provider_failure(AnymailRecipientsRefused("refused", esp_name="Postmark"))
    assert isinstance(sorted_, mail.RecipientRejected)
