"""Django's SMTP backend, able to send to an address with a UTF-8 local part (RFC 6531).

Django 5.2 passes every address through ``sanitize_address``, which puts a non-ASCII local
part into an RFC 2047 encoded word: ``=?utf-8?b?...?=@example.com`` names another mailbox, in
the envelope and in the headers alike. A message with such an address is sent here with the
SMTPUTF8 extension instead: the addresses as UTF-8 in ``MAIL FROM``, ``RCPT TO`` and the
address headers (RFC 6532), serialised by the standard library's ``SMTPUTF8`` policy. A server
that does not offer SMTPUTF8 is never handed one: ``SMTPNotSupportedError`` is raised before
``MAIL FROM``, naming the address, and the caller decides what that means
(``invoicing.mail.deliver``: a permanent failure).

A message whose addresses are all ASCII, display names aside, takes Django's own ``_send``.
"""

from __future__ import annotations

import email.policy
import smtplib
from email.generator import BytesGenerator
from io import BytesIO

from django.core.mail import EmailMessage
from django.core.mail.backends import smtp


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


class EmailBackend(smtp.EmailBackend):
    # Django's per-message step (django/core/mail/backends/smtp.py); django-stubs omits it.
    def _send(self, email_message: EmailMessage) -> bool:
        if not email_message.recipients():
            return False
        addresses = [email_message.from_email, *email_message.recipients()]
        utf8 = [address_spec(a) for a in addresses if needs_smtputf8(a)]
        if not utf8:
            return bool(super()._send(email_message))  # type: ignore[misc]
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
        # Django's message classes take no policy in their as_bytes: the standard generator does.
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
