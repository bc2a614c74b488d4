"""Building the invoice email and sending it, with SMTP failures sorted into transient and
permanent.

Transient (retried): SMTP 4xx replies, connection refused or reset, timeouts, disconnects.
Permanent (dead-lettered at once): SMTP 5xx replies, a missing or invalid recipient, an address
carrying a line break (header injection), an address the server cannot take (a UTF-8 local
part, and no SMTPUTF8 offered).

What came in a signed event is authentic, not harmless, so before it reaches the message:

* the recipient is validated by email-validator: an internationalised domain is sent in its
  ASCII form (IDNA 2008), which every server takes; a UTF-8 local part is kept as it is and
  needs a server offering SMTPUTF8 (``invoicing.smtp``);
* the customer's name and the invoice number lose every control character and line or
  paragraph separator (each becomes a space): Python's email package breaks a header line on
  ``\v``, ``\f``, ``\x1c``-``\x1e``, ``\x85``, U+2028 and U+2029 as well as on CR and LF;
* the hosted invoice URL is linked only when it is ``https`` on a host in
  ``INVOICE_URL_ALLOWED_HOSTS``, with no user info and no other port; otherwise the email goes
  out without the link and a warning is logged with the invoice id and the reason.
"""

from __future__ import annotations

import ast
import logging
import re
import smtplib
from collections.abc import Mapping
from decimal import Decimal
from email.headerregistry import Address
from email.utils import parseaddr
from urllib.parse import urlsplit

import email_validator
from django.conf import settings
from django.core.mail import EmailMultiAlternatives, get_connection
from django.template.loader import render_to_string

from asyncwork.db import text_storable
from asyncwork.errors import PermanentError, TransientError
from invoicing.models import Invoice

logger = logging.getLogger(__name__)

# ISO 4217 exponents that are not 2, for the currencies Stripe supports.
_ZERO_DECIMAL = frozenset(
    [
        "bif",
        "clp",
        "djf",
        "gnf",
        "jpy",
        "kmf",
        "krw",
        "mga",
        "pyg",
        "rwf",
        "ugx",
        "vnd",
        "vuv",
        "xaf",
        "xof",
        "xpf",
    ]
)
_THREE_DECIMAL = frozenset(["bhd", "jod", "kwd", "omr", "tnd"])


def format_amount(minor: int, currency: str) -> str:
    """``1234, "usd"`` -> ``"12.34 USD"``; ``1200, "jpy"`` -> ``"1,200 JPY"``."""
    code = currency.lower()
    exponent = 0 if code in _ZERO_DECIMAL else 3 if code in _THREE_DECIMAL else 2
    amount = Decimal(minor).scaleb(-exponent)
    return f"{amount:,.{exponent}f} {code.upper()}".strip()


def message_id_domain() -> str:
    _, address = parseaddr(settings.DEFAULT_FROM_EMAIL)
    return address.rpartition("@")[2] or "localhost"


# C0 controls, DEL, C1 controls, and the line and paragraph separators.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def header_text(value: str) -> str:
    """``value`` fit for one header line: each control character or line/paragraph separator
    becomes a space, runs of white space become one, lone surrogates become U+FFFD."""
    return " ".join(_CONTROLS.sub(" ", text_storable(value)).split())


def recipient_address(*, email: str, name: str) -> str:
    """The To address for ``email`` with ``name`` as its display name, or ``PermanentError``.

    A line break in the address stays a permanent error rather than being repaired: unlike a
    name, there is no telling which address was meant, and guessing could mail a stranger."""
    address = email.strip()
    if not address:
        raise PermanentError("invoice has no customer email")
    if _CONTROLS.search(address):
        raise PermanentError(
            "header injection in customer email: a line break or control character in it"
        )
    if "\ufffd" in address:
        # What a lone surrogate was stored as: no mailbox is named that.
        raise PermanentError(f"invalid recipient address {address!r}: it held unencodable text")
    try:
        valid = email_validator.validate_email(address, check_deliverability=False)
    except email_validator.EmailNotValidError as exc:
        raise PermanentError(f"invalid recipient address {address!r}: {exc}") from exc
    if valid.ascii_email:
        # Any server takes this: the domain as IDNA (xn--...), the local part as given.
        username, domain = valid.ascii_local_part, valid.ascii_domain
    else:
        # A UTF-8 local part: sent with SMTPUTF8 if the server offers it (invoicing.smtp).
        username, domain = valid.local_part, valid.domain
    # Address quotes a display name where RFC 5322 needs it.
    return str(Address(display_name=header_text(name), username=username, domain=domain))


def _url_refusal(url: str) -> str:
    """Why ``url`` is not linked from the email, or "" if it may be."""
    if not re.fullmatch(r"[!-\[\]-~]+", url):
        return "not printable ASCII, or contains a backslash or space"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "not a URL"
    if parts.scheme != "https":
        return "not https"
    if "@" in parts.netloc:
        return "carries user info"
    if port not in (None, 443):
        return "has a port other than 443"
    if parts.hostname not in settings.INVOICE_URL_ALLOWED_HOSTS:
        return f"host {(parts.hostname or '')[:100]!r} is not in INVOICE_URL_ALLOWED_HOSTS"
    return ""


def invoice_url(invoice: Invoice) -> str:
    """The invoice's hosted URL if it is safe to link to, else "" (and a warning)."""
    url = invoice.hosted_invoice_url
    if not url:
        return ""
    refusal = _url_refusal(url)
    if refusal:
        # Not the URL itself: it is the sender's text, and may be built to mislead a reader.
        logger.warning(
            "hosted invoice URL left out of the email: %s",
            refusal,
            extra={"invoice_id": invoice.pk, "reason": refusal},
        )
        return ""
    return url


def invoice_email_build(*, invoice: Invoice, message_id: str) -> EmailMultiAlternatives:
    """The paid-invoice email, to the invoice's recipient: an operator's correction if there
    is one, else the provider's customer email."""
    to = recipient_address(email=invoice.recipient, name=invoice.customer_name)
    context = {
        "name": header_text(invoice.customer_name),
        "number": header_text(invoice.number or invoice.provider_invoice_id),
        "amount": format_amount(invoice.amount_paid, invoice.currency or "usd"),
        "invoice_url": invoice_url(invoice),
    }
    message = EmailMultiAlternatives(
        subject=f"Your invoice {context['number']} is paid",
        body=render_to_string("invoicing/email/invoice_paid.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[to],
        headers={"Message-ID": message_id},
    )
    message.attach_alternative(
        render_to_string("invoicing/email/invoice_paid.html", context), "text/html"
    )
    return message


def smtp_reply_text(code: int, reply: bytes | str) -> str:
    """An SMTP reply in words, as an operator reads it: ``550 5.1.1 mailbox unavailable``.

    The server's text is decoded (bytes that are not UTF-8 become U+FFFD) and put on one line
    with no control character (a multi-line reply's lines joined): it is stored on the dead
    letter and shown in the admin, and PostgreSQL refuses a NUL in text."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
    return header_text(f"{code} {text}")


def refused_recipients_text(recipients: Mapping[str, tuple[int, bytes | str]]) -> str:
    """``{'Jenny <x@y>': (550, b'5.1.1 mailbox unavailable')}`` (smtplib's ``recipients``,
    keyed by the address as Django gave it) in words: ``550 5.1.1 mailbox unavailable (x@y)``,
    one per refused recipient."""
    return "; ".join(
        f"{smtp_reply_text(code, reply)} ({header_text(parseaddr(address)[1] or address)})"
        for address, (code, reply) in recipients.items()
    )


_OLD_REFUSAL = re.compile(r"recipient (refused|deferred): (\{.*\})", re.DOTALL)
_OLD_REPLY = re.compile(r"SMTP (\d{3}): (b'.*'|b\".*\")", re.DOTALL)


def failure_in_words(message: str) -> str:
    """The failure an email job stored, in words: the message as ``deliver`` words it now, and
    for a dead letter recorded before it did (``recipient refused: {'x@y': (550, b'...')}``,
    ``SMTP 550: b'...'``) the same words read back out of Python's repr."""
    try:
        if refusal := _OLD_REFUSAL.fullmatch(message):
            recipients = ast.literal_eval(refusal[2])
            return f"recipient {refusal[1]}: {refused_recipients_text(recipients)}"
        if reply := _OLD_REPLY.fullmatch(message):
            return f"SMTP {smtp_reply_text(int(reply[1]), ast.literal_eval(reply[2]))}"
    except (ValueError, TypeError, SyntaxError, AttributeError, MemoryError, RecursionError):
        pass  # not what an older ``deliver`` wrote after all: shown as it was stored
    return message


def _words(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def deliver(message: EmailMultiAlternatives) -> None:
    """Send through Django's email backend, bounded by ``EMAIL_TIMEOUT`` on every socket
    operation, and classify what went wrong.

    Each error says what happened in words an operator can act on (``recipient refused: 550
    5.1.1 mailbox unavailable (x@y)``), which the dead letter keeps as its message; smtplib's
    own exception, with its raw reply, stays chained to it and so in the traceback."""
    connection = get_connection(timeout=settings.EMAIL_TIMEOUT)
    try:
        message.connection = connection
        message.send()
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        refused = refused_recipients_text(exc.recipients)
        if codes and all(400 <= code < 500 for code in codes):
            raise TransientError(f"recipient deferred: {refused}") from exc
        raise PermanentError(f"recipient refused: {refused}") from exc
    except smtplib.SMTPResponseException as exc:
        reply = smtp_reply_text(exc.smtp_code, exc.smtp_error)
        if 400 <= exc.smtp_code < 500:
            raise TransientError(f"SMTP {reply}") from exc
        raise PermanentError(f"SMTP {reply}") from exc
    except (smtplib.SMTPServerDisconnected, ConnectionError, TimeoutError) as exc:
        raise TransientError(f"SMTP unavailable: {_words(exc)}") from exc
    except smtplib.SMTPNotSupportedError as exc:  # invoicing.smtp: a UTF-8 address, no SMTPUTF8
        raise PermanentError(f"the mail server cannot take this address: {exc}") from exc
    except smtplib.SMTPException as exc:
        raise PermanentError(f"SMTP error: {_words(exc)}") from exc
    except ValueError as exc:  # Django's address sanitising and BadHeaderError
        raise PermanentError(f"malformed message: {exc}") from exc
    except OSError as exc:  # unreachable network, DNS failure
        raise TransientError(f"SMTP unreachable: {_words(exc)}") from exc
