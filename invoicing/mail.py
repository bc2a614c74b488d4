"""The paid-invoice email, built for ``asyncwork.contrib.mail.deliver``: its amount in the
currency's minor unit, and its recipient and content made safe. A signed event is authentic, not
harmless: the recipient is validated (email-validator), the name and number lose every character
Python's email package breaks a header line on, and the hosted URL is linked only over https to a
host in ``INVOICE_URL_ALLOWED_HOSTS``.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from email.headerregistry import Address
from email.utils import parseaddr
from urllib.parse import urlsplit

import email_validator
from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.template.loader import render_to_string

from asyncwork.contrib.mail import CONTROLS, RecipientRejected, header_text
from invoicing.models import Invoice

logger = logging.getLogger(__name__)

# The metadata name a provider keeps a message's delivery key under (anymail's ``metadata``).
DELIVERY_KEY_METADATA = "delivery_key"

# ISO 4217 exponents that are not 2, for the currencies Stripe supports.
_ZERO_DECIMAL = frozenset(
    "bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split()  # noqa: SIM905
)
_THREE_DECIMAL = frozenset(["bhd", "jod", "kwd", "omr", "tnd"])


def _exponent(currency: str) -> int:
    """How many decimals an amount in ``currency`` has (its minor unit)."""
    code = currency.lower()
    return 0 if code in _ZERO_DECIMAL else 3 if code in _THREE_DECIMAL else 2


def format_amount(minor: int, currency: str) -> str:
    """``1234, "usd"`` -> ``"12.34 USD"``; ``1200, "jpy"`` -> ``"1,200 JPY"``."""
    exponent = _exponent(currency)
    amount = Decimal(minor).scaleb(-exponent)
    return f"{amount:,.{exponent}f} {currency.upper()}".strip()


def amount_minor(text: str, currency: str) -> int:
    """``"12.34", "usd"`` -> ``1234``; ``"1200", "jpy"`` -> ``1200``: an amount as a person writes
    it, in integer minor units. ``ValueError`` says why one is refused."""
    try:
        amount = Decimal(text.strip())
    except ArithmeticError:
        raise ValueError(f"{text!r} is not an amount (e.g. 12.34)") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{text!r} is not an amount (e.g. 12.34)")
    minor = amount.scaleb(_exponent(currency))
    if minor != minor.to_integral_value():
        places = _exponent(currency)
        raise ValueError(f"{text!r} has more than {places} decimal(s), as {currency.upper()} has")
    return int(minor)


def message_id_domain() -> str:
    return parseaddr(settings.DEFAULT_FROM_EMAIL)[1].rpartition("@")[2] or "localhost"


def recipient_address(*, email: str, name: str) -> str:
    """The To address for ``email`` with ``name`` as its display name, or ``RecipientRejected``.
    A line break in the address is not repaired: guessing could mail a stranger."""
    address = email.strip()
    if not address:
        raise RecipientRejected("invoice has no customer email")
    if CONTROLS.search(address):
        raise RecipientRejected(
            "header injection in customer email: a line break or control character in it"
        )
    if "\ufffd" in address:
        # What a lone surrogate was stored as: no mailbox is named that.
        raise RecipientRejected(f"invalid recipient address {address!r}: it held unencodable text")
    try:
        valid = email_validator.validate_email(address, check_deliverability=False)
    except email_validator.EmailNotValidError as exc:
        raise RecipientRejected(f"invalid recipient address {address!r}: {exc}") from exc
    if valid.ascii_email:
        # Any server takes this: the domain as IDNA (xn--...), the local part as given.
        username, domain = valid.ascii_local_part, valid.ascii_domain
    else:
        # A UTF-8 local part: sent with SMTPUTF8 if the server offers it (EmailBackend).
        username, domain = valid.local_part, valid.domain
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
        # Not the URL itself: it may be built to mislead a reader.
        logger.warning(
            "hosted invoice URL left out of the email: %s",
            refusal,
            extra={"invoice_id": invoice.pk, "reason": refusal},
        )
        return ""
    return url


def invoice_email_build(*, invoice: Invoice, message_id: str, key: str) -> EmailMultiAlternatives:
    """The paid-invoice email, to ``invoice.recipient``; a provider's backend (django-anymail)
    sends its delivery ``key`` as the message's metadata, which its tracking events carry back
    (``invoicing.bounces``). SMTP sends no metadata."""
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
    message.metadata = {DELIVERY_KEY_METADATA: key}  # type: ignore[attr-defined]
    return message
