"""Building the invoice email and sending it, with SMTP failures sorted into transient and
permanent.

Transient (retried): SMTP 4xx replies, connection refused or reset, timeouts, disconnects.
Permanent (dead-lettered at once): SMTP 5xx replies, a missing or invalid recipient, a header
carrying a line break (header injection).
"""

from __future__ import annotations

import smtplib
from decimal import Decimal
from email.utils import formataddr, parseaddr

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import EmailMultiAlternatives, get_connection
from django.core.validators import validate_email
from django.template.loader import render_to_string

from core.tasks import PermanentError, TransientError
from invoicing.models import Invoice

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


def _reject_line_breaks(name: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise PermanentError(f"header injection in {name}: a line break in the value")


def invoice_email_build(*, invoice: Invoice, message_id: str) -> EmailMultiAlternatives:
    """The paid-invoice email, to the invoice's recipient: an operator's correction if there
    is one, else the provider's customer email."""
    recipient = invoice.recipient.strip()
    if not recipient:
        raise PermanentError("invoice has no customer email")
    _reject_line_breaks("customer email", invoice.recipient)
    _reject_line_breaks("customer name", invoice.customer_name)
    _reject_line_breaks("invoice number", invoice.number)
    try:
        validate_email(recipient)
    except ValidationError as exc:
        raise PermanentError(f"invalid recipient address {recipient!r}") from exc

    context = {
        "invoice": invoice,
        "number": invoice.number or invoice.provider_invoice_id,
        "amount": format_amount(invoice.amount_paid, invoice.currency or "usd"),
    }
    message = EmailMultiAlternatives(
        subject=f"Your invoice {context['number']} is paid",
        body=render_to_string("invoicing/email/invoice_paid.txt", context),
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=[formataddr((invoice.customer_name, recipient)) if invoice.customer_name else recipient],
        headers={"Message-ID": message_id},
    )
    message.attach_alternative(
        render_to_string("invoicing/email/invoice_paid.html", context), "text/html"
    )
    return message


def deliver(message: EmailMultiAlternatives) -> None:
    """Send through Django's email backend, bounded by ``EMAIL_TIMEOUT`` on every socket
    operation, and classify what went wrong."""
    connection = get_connection(timeout=settings.EMAIL_TIMEOUT)
    try:
        message.connection = connection
        message.send()
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        if codes and all(400 <= code < 500 for code in codes):
            raise TransientError(f"recipient deferred: {exc.recipients}") from exc
        raise PermanentError(f"recipient refused: {exc.recipients}") from exc
    except smtplib.SMTPResponseException as exc:
        if 400 <= exc.smtp_code < 500:
            raise TransientError(f"SMTP {exc.smtp_code}: {exc.smtp_error!r}") from exc
        raise PermanentError(f"SMTP {exc.smtp_code}: {exc.smtp_error!r}") from exc
    except (smtplib.SMTPServerDisconnected, ConnectionError, TimeoutError) as exc:
        raise TransientError(f"SMTP unavailable: {exc!r}") from exc
    except smtplib.SMTPException as exc:
        raise PermanentError(f"SMTP error: {exc!r}") from exc
    except ValueError as exc:  # Django's address sanitising and BadHeaderError
        raise PermanentError(f"malformed message: {exc}") from exc
    except OSError as exc:  # unreachable network, DNS failure
        raise TransientError(f"SMTP unreachable: {exc!r}") from exc
