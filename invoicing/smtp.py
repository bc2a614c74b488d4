"""Django's SMTP backend, able to send to an address with a UTF-8 local part (RFC 6531).

Django 5.2 passes every address through ``sanitize_address``, which puts a non-ASCII local
part into an RFC 2047 encoded word: ``=?utf-8?b?...?=@example.com`` names another mailbox, in
the envelope and in the headers alike. A message with such an address is sent here with the
SMTPUTF8 extension instead: the addresses as UTF-8 in ``MAIL FROM``, ``RCPT TO`` and the
address headers (RFC 6532). A server that does not offer SMTPUTF8 is never handed one:
``SMTPNotSupportedError`` is raised before ``MAIL FROM``, naming the address, and the caller
decides what that means (``invoicing.mail.deliver``: a permanent failure).

A message whose addresses are all ASCII, display names aside, takes Django's own steps (its
address sanitising, its message, its errors), but for the envelope's recipients written the
plain way (``envelope_recipient``); a domain is expected in its ASCII (IDNA) form
there, as ``invoicing.mail`` gives it. Only the serialising differs, for CPU (it was most of an
email's cost, by cProfile of the task): a header that Django has made ASCII (non-ASCII text as
RFC 2047 encoded words, folded where it encoded them) and whose lines fit 78 characters is
written as it stands rather than passed through ``email.header``'s folder again, which
returned it unchanged; a longer one is folded as Django's serialising folds it; and the
multipart boundary is checked against the text with a substring test instead of a regular
expression compiled per message. The connection, timeout, TLS, authentication and the errors
raised are all Django's.
"""

from __future__ import annotations

import email.policy
import functools
import random
import re
import smtplib
import sys
from email._policybase import Compat32, Policy
from email.generator import BytesGenerator
from email.message import Message
from io import BytesIO
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage
from django.core.mail.backends import smtp
from django.core.mail.message import sanitize_address


def address_spec(address: str) -> str:
    """The ``local@domain`` of one address (``Name <local@domain>`` or bare)."""
    # The modern parser reads a UTF-8 local part (noting a defect); Django's sanitiser mangles it.
    mailboxes = email.policy.SMTPUTF8.header_factory("To", address).addresses
    if len(mailboxes) != 1 or not mailboxes[0].domain:
        raise ValueError(f"invalid address {address!r}")
    return mailboxes[0].addr_spec


def needs_smtputf8(address: str) -> bool:
    """Whether the address's ``local@domain`` itself (not its display name) is not ASCII."""
    return not address.isascii() and not address_spec(address).isascii()


# UTF-8 headers (RFC 6532), CRLF, each header written as it stands: refolding a long address
# header with utf8=True drops the quotes around a display name holding a comma (CPython's
# folder), which turns one recipient into two. Django folded the headers it encoded itself.
_AS_WRITTEN = email.policy.SMTPUTF8.clone(refold_source="none")


class _Compat32AsWritten(Compat32):
    """Django's policy (``compat32``), but a header whose lines are ASCII and fit
    ``max_line_length`` is written as it stands instead of going through ``email.header``'s
    folder again, which returns it unchanged at many times the cost of the rest of the
    message. A longer header is folded as before."""

    def _fold(self, name: str, value: Any, sanitize: bool) -> str:
        if isinstance(value, str) and value.isascii():
            lines = value.splitlines()
            limit = self.max_line_length or 998
            if (
                lines
                and len(name) + 2 + len(lines[0]) <= limit
                and all(len(line) <= limit for line in lines[1:])
            ):
                return name + ": " + self.linesep.join(lines) + self.linesep
        return str(super()._fold(name, value, sanitize))  # type: ignore[misc]


# The ASCII path: the headers Django has already made ASCII (and folded where it encoded).
_ASCII_AS_WRITTEN = _Compat32AsWritten(linesep="\r\n")


class _Generator(BytesGenerator):
    """The standard generator, with a boundary checked by substring: a line of the text that
    starts with ``--<boundary>`` contains it, so the test is stricter than the standard one,
    which compiles a regular expression for each message."""

    @classmethod
    def _make_boundary(cls, text: bytes | str | None = None) -> str:
        while True:
            boundary = "=" * 15 + f"{random.randrange(sys.maxsize):019d}" + "=="  # noqa: S311 - not a secret
            marker = f"--{boundary}"
            if text is None:
                return boundary
            if isinstance(text, bytes):
                if marker.encode() not in text:
                    return boundary
            elif marker not in text:
                return boundary


def _as_bytes(message: Message, policy: Policy) -> bytes:
    data = BytesIO()
    _Generator(data, mangle_from_=False, policy=policy).flatten(message, linesep="\r\n")
    return data.getvalue()


@functools.lru_cache(maxsize=16)
def _sanitized(address: str, encoding: str) -> str:
    """Django's ``sanitize_address``, kept for the sender's address, the same for every email."""
    return str(sanitize_address(address, encoding))


# A recipient written the plain way, ``mailbox`` or ``name <mailbox>``: a dot-atom local part, a
# domain of ASCII labels, and a display name with nothing RFC 5322 reads as structure.
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_PLAIN_RECIPIENT = re.compile(
    rf"""(?:[^<>"\\(),;:@\[\]\r\n]*<({_ATEXT}(?:\.{_ATEXT})*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)>"""
    rf"""|({_ATEXT}(?:\.{_ATEXT})*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*))"""
)


def envelope_recipient(address: str, encoding: str) -> str:
    """What Django's ``sanitize_address(address)`` gives for the envelope (``RCPT TO``), where
    only the mailbox counts (smtplib's ``quoteaddr`` drops the display name). A recipient
    written the plain way has its mailbox taken by a regular expression, then sanitised as
    Django sanitises it (the checks of the domain included), without its display name: Django's
    full RFC 5322 parse, and the encoding of a name that is then dropped, were a tenth of an
    email's CPU in the worker. Any other form is Django's to read, and to refuse."""
    plain = _PLAIN_RECIPIENT.fullmatch(address)
    if plain is None:
        return str(sanitize_address(address, encoding))
    return str(sanitize_address(("", plain[1] or plain[2]), encoding))


class EmailBackend(smtp.EmailBackend):
    # Django's per-message step (django/core/mail/backends/smtp.py); django-stubs omits it.
    def _send(self, email_message: EmailMessage) -> bool:
        addresses = [email_message.from_email, *email_message.recipients()]
        utf8 = [address_spec(a) for a in addresses if needs_smtputf8(a)]
        if not email_message.recipients():
            return False
        if not utf8:
            return self._send_ascii(email_message)
        message = email_message.message()
        # Django's headers carry the sanitised (encoded-word) addresses: put back the addresses
        # as written, which RFC 6532 allows in UTF-8. Django refused any line break in them
        # while building the message.
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
                _as_bytes(message, _AS_WRITTEN),
                mail_options=["SMTPUTF8", "BODY=8BITMIME"],
            )
        except smtplib.SMTPException:
            if not self.fail_silently:
                raise
            return False
        return True

    def _send_ascii(self, email_message: EmailMessage) -> bool:
        """Django's ``_send`` (django/core/mail/backends/smtp.py), step for step, serialised by
        ``_as_bytes``."""
        encoding = email_message.encoding or settings.DEFAULT_CHARSET
        from_email = _sanitized(email_message.from_email, encoding)
        recipients = [envelope_recipient(a, encoding) for a in email_message.recipients()]
        message = email_message.message()
        assert self.connection is not None  # send_messages opened it
        try:
            self.connection.sendmail(from_email, recipients, _as_bytes(message, _ASCII_AS_WRITTEN))
        except smtplib.SMTPException:
            if not self.fail_silently:
                raise
            return False
        return True
