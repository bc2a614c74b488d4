"""Sending one email through ``EMAIL_BACKEND`` (SMTP, or a provider's API through django-anymail)
and sorting its failures for a task: transient (SMTP 4xx, HTTP 429: retried), unreachable
(refused, reset, timed out, SMTP 421, HTTP 5xx: retried, and what a breaker counts) or permanent
(SMTP 5xx, HTTP 4xx: dead-lettered at once; the recipient's failures as ``RecipientRejected``).

``deliver(message)`` sends over a connection the thread keeps open across messages and returns
the provider's message id; ``EmailBackend`` is Django's SMTP backend able to send to a UTF-8
local part (SMTPUTF8). Needs ``asyncwork[mail]`` (django-anymail).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import smtplib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.generator import BytesGenerator
from email.policy import SMTPUTF8
from email.utils import parseaddr
from io import BytesIO
from typing import Any

import requests
from anymail.backends.base import AnymailBaseBackend
from anymail.exceptions import (
    AnymailAPIError,
    AnymailError,
    AnymailInvalidAddress,
    AnymailRecipientsRefused,
)
from celery.signals import worker_process_shutdown
from django.conf import settings
from django.core.mail import EmailMessage, EmailMultiAlternatives, get_connection
from django.core.mail.backends import smtp

from asyncwork.db import text_storable
from asyncwork.errors import PermanentError, TransientError, Unreachable

# A thread's kept SMTP connection is replaced after this many messages or seconds.
CONNECTION_MAX_MESSAGES = 100
CONNECTION_MAX_AGE_SECONDS = 60

# C0 controls, DEL, C1 controls, and the line and paragraph separators.
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def header_text(value: str) -> str:
    """``value`` on one header line: controls and separators become spaces, runs of white space
    one, lone surrogates U+FFFD."""
    return " ".join(CONTROLS.sub(" ", text_storable(value)).split())


class RecipientRejected(PermanentError):
    """The recipient's address is the failure: invalid, refused by the server or the provider,
    or bounced. Correcting the recipient is the fix; a replay without it fails again."""


def smtp_reply_text(code: int, reply: bytes | str) -> str:
    """An SMTP reply on one storable line: ``550 5.1.1 mailbox unavailable``."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    return header_text(f"{code} {text}")


def refused_recipients_text(recipients: Mapping[str, tuple[int, bytes | str]]) -> str:
    """smtplib's ``recipients`` in words: ``550 5.1.1 mailbox unavailable (x@y); ...``."""
    return "; ".join(
        f"{smtp_reply_text(code, reply)} ({header_text(parseaddr(address)[1] or address)})"
        for address, (code, reply) in recipients.items()
    )


def _words(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


@dataclass
class _Kept:
    """An SMTP connection this thread keeps open across messages."""

    key: tuple[Any, ...]  # the process and the settings it was opened with
    connection: Any
    opened_at: float
    sent: int = 0

    def __del__(self) -> None:
        # Its thread ended or a forked child let it go: close the socket without QUIT, which
        # could wait on a dead server from a finalizer.
        with contextlib.suppress(Exception):
            self.connection.connection.close()


_local = threading.local()


def _dropped(connection: Any) -> bool:
    """Whether the server closed the connection or spoke unasked (a 421): the socket is gone or
    readable with no command pending. No round trip."""
    sock = getattr(getattr(connection, "connection", None), "sock", None)
    if sock is None:
        return True
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def _connection_discard() -> None:
    """Close this thread's kept connection; one inherited across a fork is only dropped, as
    the parent owns its socket."""
    kept: _Kept | None = _local.__dict__.pop("kept", None)
    if kept is not None and kept.key[0] == os.getpid():
        with contextlib.suppress(Exception):
            kept.connection.close()


def _connection_kept() -> Any:
    """This thread's SMTP connection, kept across messages within the bounds above and
    replaced once dropped or the settings changed. A non-SMTP backend is returned fresh."""
    kept: _Kept | None = getattr(_local, "kept", None)
    key = (
        os.getpid(),
        settings.EMAIL_BACKEND,
        settings.EMAIL_HOST,
        settings.EMAIL_PORT,
        settings.EMAIL_HOST_USER,
        settings.EMAIL_HOST_PASSWORD,
        settings.EMAIL_USE_TLS,
        settings.EMAIL_USE_SSL,
        settings.EMAIL_TIMEOUT,
    )
    if kept is not None and (
        kept.key != key
        or kept.sent >= CONNECTION_MAX_MESSAGES
        or time.monotonic() - kept.opened_at > CONNECTION_MAX_AGE_SECONDS
        or _dropped(kept.connection)
    ):
        _connection_discard()
        kept = None
    if kept is None:
        connection = get_connection(timeout=settings.EMAIL_TIMEOUT)
        if not isinstance(connection, smtp.EmailBackend):
            return connection
        connection.open()
        kept = _local.kept = _Kept(key=key, connection=connection, opened_at=time.monotonic())
    return kept.connection


def _send(message: EmailMultiAlternatives) -> None:
    """Send over the kept connection, closed after any failure; never sends twice here. After
    the 250, RSET tells the server its reply was read; a failed RSET only closes the
    connection: raising would send the delivered message again."""
    try:
        message.connection = _connection_kept()
        message.send()
    except BaseException:
        _connection_discard()
        raise
    kept: _Kept | None = getattr(_local, "kept", None)
    if kept is None:
        return
    kept.sent += 1
    try:
        code, _ = kept.connection.connection.rset()
    except (smtplib.SMTPException, OSError):
        code = 0
    if code != 250:
        _connection_discard()


@worker_process_shutdown.connect(weak=False, dispatch_uid="asyncwork.contrib.mail.close")
def smtp_connection_close(**_: Any) -> None:
    """Close this thread's kept SMTP connection with QUIT as the worker process exits."""
    _connection_discard()


def _answer_words(
    esp_name: str | None, code: int | None, response: requests.Response | None, otherwise: str
) -> str:
    """What a provider's API answered, on one storable line: its own message where its JSON
    has one (Postmark's ``Message``, most others' ``message``), else the start of the body;
    ``otherwise`` when it gave none."""
    status = f" {code}" if code is not None else ""
    said = ""
    if response is not None:
        try:
            body = response.json()
        except ValueError:
            said = response.text[:300]
        else:
            found = body.get("Message") or body.get("message") if isinstance(body, dict) else None
            said = str(found) if found else json.dumps(body)[:300]
    return header_text(f"{esp_name or 'the provider'}{status}: {said or otherwise}")


def provider_words(exc: AnymailError) -> str:
    """A provider API's failure in its own words; with no answer, what failed on the way
    (anymail's first line, then its cause)."""
    response = exc.response
    return _answer_words(
        exc.esp_name,
        exc.status_code if response is None else response.status_code,
        response,
        otherwise=str(exc.__cause__ or "") or str(exc).partition("\n")[0],
    )


def _retry_after(exc: AnymailAPIError) -> float | None:
    """A 429's ``Retry-After`` in seconds, if it gave one as a number."""
    value = exc.response.headers.get("Retry-After") if exc.response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _provider_failure(exc: AnymailError) -> Exception:
    """A provider API's failure (django-anymail) as the task takes it: a refused or invalid
    recipient is ``RecipientRejected``; no answer (refused, reset, timed out) and 5xx are
    ``Unreachable``; 429 and 408 ``TransientError`` (429 with its ``Retry-After``); any other
    answer (a 4xx: bad token, a sender not confirmed) is ``PermanentError``."""
    words = provider_words(exc)
    if isinstance(exc, AnymailRecipientsRefused):
        return RecipientRejected(f"recipient refused: {words}")
    if isinstance(exc, AnymailInvalidAddress):
        return RecipientRejected(f"invalid recipient address: {words}")
    if not isinstance(exc, AnymailAPIError):  # anymail's own checks: a message it cannot send
        return PermanentError(f"malformed message: {words}")
    status = exc.status_code
    if status is None:
        if isinstance(exc, (requests.RequestException, OSError)):
            return Unreachable(f"email provider unreachable: {words}")
        return TransientError(f"email provider failed: {words}")
    if status >= 500:
        return Unreachable(f"email provider unavailable: {words}")
    if status == 429:
        return TransientError(f"email provider rate limit: {words}", retry_after=_retry_after(exc))
    if status == 408:
        return TransientError(f"email provider timed out: {words}")
    return PermanentError(f"email provider refused the message: {words}")


# anymail's per-recipient statuses: what it is for the address we sent to decides the outcome.
ACCEPTED = frozenset({"sent", "queued"})
REFUSED = frozenset({"invalid", "rejected"})


def _status_address(address: str) -> str:
    """The lower-case ``local@domain`` anymail's status is keyed under; a provider's reply can
    name a recipient with its display name, which anymail keeps whole."""
    try:
        return address_spec(address).lower()
    except ValueError:
        return address.strip().lower()


def _provider_accepted(message: EmailMultiAlternatives) -> str:
    """After a provider's API took the request without raising: the provider's message id if it
    accepted the email for the one address we sent it to, else a failure, never a success.
    anymail raises only when every recipient it could name was refused; a reply naming the
    address otherwise (Postmark's 422 quotes ``Name <address>`` whole) leaves ours ``unknown``
    and ``send()`` returning 1. So: ``sent`` or ``queued`` for our address is sent; ``invalid``
    or ``rejected`` is ``RecipientRejected``; anything else (``unknown``, no status, a status
    for another address) is ``PermanentError`` in the provider's words: retrying a send that
    may have gone out could send it twice, so an operator decides."""
    status = message.anymail_status  # type: ignore[attr-defined]
    (to,) = message.to
    ours = _status_address(to)
    statuses = {_status_address(a): s for a, s in (status.recipients or {}).items()}
    response = status.esp_response
    said = _answer_words(
        getattr(message.connection, "esp_name", None),
        response.status_code if response is not None else None,
        response,
        otherwise="no answer recorded",
    )
    mine = statuses.get(ours)
    if mine is not None and mine.status in REFUSED:
        raise RecipientRejected(f"recipient refused: {said}")
    if mine is None or mine.status not in ACCEPTED:
        raise PermanentError(
            "email provider did not accept the message for its recipient (status "
            f"{mine.status if mine is not None else 'none'} for {ours}): {said}"
        )
    return str(mine.message_id or "")


def deliver(message: EmailMultiAlternatives) -> str:
    """Send over this thread's kept connection (``EMAIL_TIMEOUT`` on every socket operation, and
    as a provider API's request timeout); return the provider's message id (``""`` over SMTP,
    whose 250 is the acceptance); raise ``TransientError``, ``Unreachable`` or
    ``PermanentError`` in words an operator can act on, the backend's exception chained."""
    try:
        _send(message)
        if isinstance(message.connection, AnymailBaseBackend):
            return _provider_accepted(message)
    except AnymailError as exc:  # before OSError: anymail's API errors are requests' HTTPError
        raise _provider_failure(exc) from exc
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        refused = refused_recipients_text(exc.recipients)
        if codes and all(400 <= code < 500 for code in codes):
            raise TransientError(f"recipient deferred: {refused}") from exc
        raise RecipientRejected(f"recipient refused: {refused}") from exc
    except smtplib.SMTPResponseException as exc:
        reply = smtp_reply_text(exc.smtp_code, exc.smtp_error)
        if exc.smtp_code == 421:  # "service not available, closing transmission channel"
            raise Unreachable(f"SMTP {reply}") from exc
        if 400 <= exc.smtp_code < 500:  # this message deferred: the server answered
            raise TransientError(f"SMTP {reply}") from exc
        raise PermanentError(f"SMTP {reply}") from exc
    except (smtplib.SMTPServerDisconnected, ConnectionError, TimeoutError) as exc:
        raise Unreachable(f"SMTP unavailable: {_words(exc)}") from exc
    except smtplib.SMTPNotSupportedError as exc:  # EmailBackend: a UTF-8 address, no SMTPUTF8
        raise RecipientRejected(f"the mail server cannot take this address: {exc}") from exc
    except smtplib.SMTPException as exc:
        raise PermanentError(f"SMTP error: {_words(exc)}") from exc
    except ValueError as exc:  # Django's address sanitising and BadHeaderError
        raise PermanentError(f"malformed message: {exc}") from exc
    except OSError as exc:  # unreachable network, DNS failure
        raise Unreachable(f"SMTP unreachable: {_words(exc)}") from exc
    return ""


def address_spec(address: str) -> str:
    """The ``local@domain`` of one address (``Name <local@domain>`` or bare)."""
    # The modern parser reads a UTF-8 local part (noting a defect); Django's sanitiser mangles it.
    mailboxes = SMTPUTF8.header_factory("To", address).addresses
    if len(mailboxes) != 1 or not mailboxes[0].domain:
        raise ValueError(f"invalid address {address!r}")
    return mailboxes[0].addr_spec


def needs_smtputf8(address: str) -> bool:
    """Whether the address's ``local@domain`` itself (not its display name) is not ASCII."""
    return not address.isascii() and not address_spec(address).isascii()


# Headers written as they stand: CPython's utf8 refolding drops the quotes around a display
# name holding a comma, turning one recipient into two.
_AS_WRITTEN = SMTPUTF8.clone(refold_source="none")


class EmailBackend(smtp.EmailBackend):
    """``EMAIL_BACKEND``: Django's SMTP backend, able to send to a UTF-8 local part (RFC 6531).
    Django's ``sanitize_address`` would turn one into an RFC 2047 encoded word, naming another
    mailbox; such a message goes with SMTPUTF8, or, if the server lacks it, is refused with
    ``SMTPNotSupportedError`` before ``MAIL FROM``. All-ASCII addresses take Django's ``_send``."""

    # Django's per-message step (django/core/mail/backends/smtp.py); django-stubs omits it.
    def _send(self, email_message: EmailMessage) -> bool:
        if not email_message.recipients():
            return False
        addresses = [email_message.from_email, *email_message.recipients()]
        utf8 = [address_spec(a) for a in addresses if needs_smtputf8(a)]
        if not utf8:
            return bool(super()._send(email_message))  # type: ignore[misc]
        message = email_message.message()
        # Put back the addresses as written in place of Django's encoded words (RFC 6532);
        # Django refused any line break in them while building the message.
        extra = email_message.extra_headers
        written = {
            "From": extra.get("From", email_message.from_email),
            "To": extra.get("To", ", ".join(str(a) for a in email_message.to)),
            "Cc": extra.get("Cc", ", ".join(str(a) for a in email_message.cc)),
            "Reply-To": extra.get("Reply-To", ", ".join(str(a) for a in email_message.reply_to)),
        }
        for name, value in written.items():
            if value and name in message:
                message.replace_header(name, value)
        data = BytesIO()
        BytesGenerator(data, policy=_AS_WRITTEN).flatten(message)
        assert self.connection is not None  # send_messages opened it
        try:
            self.connection.ehlo_or_helo_if_needed()
            if not self.connection.has_extn("smtputf8"):
                raise smtplib.SMTPNotSupportedError(
                    f"the mail server does not offer SMTPUTF8, which the address {utf8[0]!r} needs"
                )
            self.connection.sendmail(
                address_spec(email_message.from_email),
                [address_spec(a) for a in email_message.recipients()],
                data.getvalue(),
                mail_options=["SMTPUTF8", "BODY=8BITMIME"],
            )
        except smtplib.SMTPException:
            if not self.fail_silently:
                raise
            return False
        return True
