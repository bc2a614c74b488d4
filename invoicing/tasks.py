"""The email guarantee: one email per paid invoice, whatever runs twice.

The key ``invoice_email_sent:<invoice pk>`` is a UNIQUE ``EmailDelivery`` row. A worker sends
only after claiming it in one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` statement, which
succeeds for a new or failed key, or a claim whose lease expired or whose owner's heartbeat
lapsed; so racing workers send one email, and a run after success is a no-op. The owner's later
writes are fenced on the claim (``Claim.update``): a late owner, once overtaken, changes nothing.

Crash window: a worker that dies between the SMTP server's 250 and marking the key sent leaves
the claim in ``sending``. Its job is run again once the worker's heartbeat lapses
(``asyncwork``'s rescue), and that run takes the claim over: at most one duplicate per crash,
with the same Message-ID. The breaker (``email_breaker``) is asked before the claim, so a
deferred job holds no claim and spends no attempt (``ProviderUnavailable``).

The email itself (``invoice_email_build``) is made safe, for a signed event is authentic, not
harmless: the recipient is validated (email-validator), the name and number lose every character
Python's email package breaks a header line on, and the hosted URL is linked only over https to a
host in ``INVOICE_URL_ALLOWED_HOSTS``.

Its tasks, Django's ``@task`` on asyncwork's backend on a queue of their own (other work never
delays an email), load by id and call ``invoice_email_send``: a transient failure is retried on
the policy below, ``ProviderUnavailable`` (the breaker open) runs again later without spending an
attempt, anything else fails the task and dead-letters it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from email.headerregistry import Address
from email.utils import parseaddr
from typing import NamedTuple
from urllib.parse import urlsplit

import email_validator
import stripe
from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.db import InterfaceError, OperationalError, connection
from django.db.models import QuerySet
from django.template.loader import render_to_string
from django.utils import timezone
from django_tasks import task
from prometheus_client import Counter

from asyncwork.contrib.breaker import Breaker, Decision
from asyncwork.contrib.mail import CONTROLS, RecipientRejected, deliver, header_text
from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.db import text_storable
from asyncwork.errors import (
    Deferred,
    PermanentError,
    ProviderUnavailable,
    TransientError,
    Unreachable,
)
from asyncwork.logging import log_context_bind
from asyncwork.runner import heartbeat_owner, lapse_seconds, owner_lapsed_sql
from invoicing.models import EmailDelivery, Invoice
from webhooks.stripe_api import stripe_client, stripe_error_sorted

logger = logging.getLogger(__name__)

# How often a run finding its email claimed by another looks again: it is sent, or the claim is
# given up (its lease or its owner's heartbeat) and this run takes it over.
CLAIMED_RECHECK_SECONDS = 5.0


class EmailInProgress(Deferred):
    """The email's claim is held by another run: this one waits for it, spending no attempt,
    rather than end as done while nothing may have been sent."""

    dead_letter_reason = "exhausted"  # DeadLetter.Reason.EXHAUSTED: the claim never ended


# Seconds a process trusts a closed-breaker read: another process's opening is seen this late.
BREAKER_CHECK_SECONDS = 1.0
_EMAIL_KEY_PREFIX = "invoice_email_sent:"


def invoice_email_key(invoice_id: int) -> str:
    """The payment email's key: one per invoice, whichever event or run asks for it."""
    return f"{_EMAIL_KEY_PREFIX}{invoice_id}"


def payment_emails() -> QuerySet[EmailDelivery]:
    """Every invoice's payment email (the keys of ``invoice_email_key``); a resend has its own."""
    return EmailDelivery.objects.filter(key__startswith=_EMAIL_KEY_PREFIX)


def invoice_email_message_id(invoice: Invoice, key: str) -> str:
    """Deterministic from the invoice and key: a duplicate after a crash carries the same one."""
    provider = re.sub(r"[^A-Za-z0-9_.-]", "", invoice.provider_invoice_id)[:64] or "invoice"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"<{provider}.{digest}@{message_id_domain()}>"


# --- The email: its content, made safe ---------------------------------------------------------
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


# Returns the claim's row, token, Message-ID and take-over flag, or no row when not claimed. A
# claimed key keeps the Message-ID it recorded first.
_CLAIM_SQL = f"""
INSERT INTO {EmailDelivery._meta.db_table} AS d
    (key, invoice_id, state, attempts, claimed_by, lease_expires_at, message_id,
     provider_message_id, recipient, last_error, requested_by, created_at, updated_at)
VALUES (%(key)s, %(invoice_id)s, 'sending', 1, %(owner)s,
        now() + make_interval(secs => %(lease)s), %(message_id)s, '', '', '', '', now(), now())
ON CONFLICT (key) DO UPDATE
    SET state = 'sending', attempts = d.attempts + 1, claimed_by = EXCLUDED.claimed_by,
        lease_expires_at = EXCLUDED.lease_expires_at, updated_at = now()
    WHERE d.state IN ('pending', 'failed', 'bounced')
       OR (d.state = 'sending' AND d.lease_expires_at < now())
       OR (d.state = 'sending' AND {owner_lapsed_sql(owner="d.claimed_by", since="d.updated_at")})
RETURNING d.id, d.attempts, d.message_id, (d.xmax <> 0) AS reclaimed
"""  # noqa: S608 - no input: a model's table name and the heartbeat's predicate

# The claim's later writes, fenced on it (``Claim.update``): plain SQL, as the claim, for every
# email runs the mark; a ``QuerySet.update()`` costs more to compile than the statement.
_FENCE = "id = %(id)s AND claimed_by = %(owner)s AND attempts = %(attempts)s"
# Sent: also after a rescue released the claim (state failed), for the message went.
_MARK_SENT_SQL = f"""
UPDATE {EmailDelivery._meta.db_table}
SET state = 'sent', sent_at = %(sent_at)s, lease_expires_at = NULL, last_error = '',
    recipient = %(recipient)s, provider_message_id = %(provider_message_id)s, bounced_at = NULL
WHERE {_FENCE} AND state IN ('sending', 'failed')
"""  # noqa: S608 - no input: a model's table name
_RELEASE_SQL = f"""
UPDATE {EmailDelivery._meta.db_table}
SET state = 'failed', lease_expires_at = NULL, last_error = %(error)s, recipient = %(recipient)s
WHERE {_FENCE} AND state = 'sending'
"""  # noqa: S608 - no input: a model's table name


@dataclass(frozen=True)
class Claim:
    """A claim held; ``attempts`` is its token, raised by every claim of the row."""

    delivery_id: int
    attempts: int
    message_id: str
    owner: str

    def update(self, sql: str, **params: str | datetime) -> int:
        """Run ``sql`` (``_MARK_SENT_SQL`` or ``_RELEASE_SQL``) on the row while this very claim
        is on it: the fence of the owner's later writes. A claim taken over since has another
        token, so it matches nothing. Returns the rows written (0 or 1)."""
        fence: dict[str, str | int | datetime] = {
            "id": self.delivery_id,
            "owner": self.owner,
            "attempts": self.attempts,
        }
        with connection.cursor() as cursor:
            cursor.execute(sql, {**params, **fence})
            return cursor.rowcount


class ClaimRead(NamedTuple):
    invoice: Invoice
    claim: Claim | None


def _invoice_read(invoice_id: int) -> Invoice:
    """Raises ``PermanentError`` if there is none: no retry would find it."""
    try:
        return Invoice.objects.get(pk=invoice_id)
    except Invoice.DoesNotExist:
        raise PermanentError(f"invoice {invoice_id} does not exist") from None


def email_claim(*, invoice_id: int, key: str, owner: str) -> ClaimRead:
    """Read the invoice, then claim its email under ``key``: claim None if the invoice is not
    paid, or the key is sent or held by a live claim. Raises ``PermanentError`` if there is no
    invoice. A paid invoice stays paid, so the status read before the claim holds under it."""
    invoice = _invoice_read(invoice_id)
    if invoice.status != Invoice.Status.PAID:
        return ClaimRead(invoice, None)
    with connection.cursor() as cursor:
        cursor.execute(
            _CLAIM_SQL,
            {
                "key": key,
                "invoice_id": invoice.pk,
                "owner": owner[:255],
                "lease": settings.EMAIL_CLAIM_LEASE_SECONDS,
                "message_id": invoice_email_message_id(invoice, key),
                "heartbeat_lapse": lapse_seconds(),
            },
        )
        row = cursor.fetchone()
    if row is None:
        return ClaimRead(invoice, None)
    delivery_id, attempts, message_id, reclaimed = row
    if reclaimed:
        logger.info(
            "email claim taken (attempt %d)",
            attempts,
            extra={"invoice_id": invoice_id, "key": key, "attempt": attempts},
        )
    claim = Claim(
        delivery_id=delivery_id, attempts=attempts, message_id=message_id, owner=owner[:255]
    )
    return ClaimRead(invoice, claim)


def _claim_release(claim: Claim, *, error: str, recipient: str) -> None:
    claim.update(_RELEASE_SQL, error=error[:2000], recipient=recipient[:320])


def _claim_mark_sent(claim: Claim, *, recipient: str, provider_message_id: str) -> bool:
    """Mark the key sent if this claim is still the row's (also after a rescue released it:
    it was sent); False if taken over. The message is already accepted, so a database blip is
    waited out (about 6 s), not turned into a retry that would send a duplicate."""
    for delay in (0.5, 1, 1.5, 3, None):
        try:
            marked = claim.update(
                _MARK_SENT_SQL,
                sent_at=timezone.now(),
                recipient=recipient[:320],
                provider_message_id=provider_message_id[:255],
            )
            return marked > 0
        except (OperationalError, InterfaceError):
            if delay is None:
                raise
            logger.warning(
                "could not mark the email sent; retrying in %.1f s",
                delay,
                extra={"delivery_id": claim.delivery_id},
            )
            connection.close()
            time.sleep(delay)
    raise AssertionError("unreachable")  # the last delay is None: raised above


def email_breaker() -> Breaker:
    """The email provider's breaker, shared by every worker, from the settings as they are now."""
    return Breaker(
        "email",
        threshold=settings.EMAIL_BREAKER_FAILURE_THRESHOLD,
        reset_seconds=settings.EMAIL_BREAKER_RESET_SECONDS,
        # A probe whose worker died frees the probe once the task's hard limit has passed.
        probe_ttl_seconds=settings.EMAIL_TASK_TIME_LIMIT + 10,
        check_seconds=BREAKER_CHECK_SECONDS,
    )


def _provider_unavailable(retry_in: float) -> ProviderUnavailable:
    return ProviderUnavailable(
        f"email provider circuit open; next try in {retry_in:.1f} s",
        retry_in=retry_in,
        jitter=settings.EMAIL_BREAKER_RESET_SECONDS,
        deadline=settings.EMAIL_PROVIDER_DEADLINE_SECONDS,
    )


def _deliver(message: EmailMultiAlternatives, *, breaker: Breaker, decision: Decision) -> str:
    """``deliver`` (the provider's message id, or ""), its outcome told to the breaker.
    Only ``Unreachable`` (refused, reset, timed out, 421) counts against it; any reply about
    the message (451 or 5xx) proves the provider up. A failed probe is deferred, not retried:
    it tested the provider for all, and charging its attempt would let a long outage exhaust
    the jobs that draw probes."""
    try:
        return deliver(message)
    except Unreachable as exc:
        breaker.record_failure()
        if decision.probe:
            raise _provider_unavailable(breaker.reset_seconds) from exc
        raise
    except (TransientError, PermanentError):
        breaker.record_success()
        raise
    # A success is told to the breaker by the caller, after the key is marked sent: nothing
    # that can fail or be interrupted (a stalled Redis, a soft time limit) may stand between
    # the SMTP server's 250 and the mark, or a retry would send the email again.


def invoice_email_send(*, invoice_id: int, owner: str, key: str | None = None) -> str:
    """Send the paid-invoice email at most once under ``key`` (default: the payment email's).
    Returns ``sent``, ``not_paid`` or ``skipped`` (sent, or claimed elsewhere). Raises
    ``TransientError`` (retry), ``PermanentError`` (dead-letter) or ``ProviderUnavailable``
    (breaker open: defer, no attempt spent)."""
    log_context_bind(invoice_id=invoice_id)
    breaker = email_breaker()
    decision = breaker.allow()
    try:
        if not decision.allowed:
            # Deferred only if there is an email to send.
            if _invoice_read(invoice_id).status != Invoice.Status.PAID:
                return _not_paid(invoice_id)
            raise _provider_unavailable(decision.retry_in)
        return _invoice_email_send_claimed(
            invoice_id=invoice_id,
            key=key or invoice_email_key(invoice_id),
            owner=owner,
            breaker=breaker,
            decision=decision,
        )
    finally:
        # A probe that never reached the provider (already sent, bad address, database error)
        # gives the probe back at once; after it recorded an outcome this is a no-op.
        breaker.release_probe(decision)


NO_RECIPIENT_WITHOUT_API = (
    "invoice has no customer email: set STRIPE_API_KEY so the recipient is read from the "
    "customer, or trigger with `stripe trigger invoice.paid --override "
    "customer:email=you@example.com`"
)


def invoice_recipient_fetch(invoice: Invoice) -> None:
    """Give an invoice with no recipient but a customer (Stripe's ``customer_email`` is null
    when the customer had no email as the invoice was finalized, as the Stripe CLI's have) the
    customer's email, read from the Stripe API in one call and kept on its row, so later sends
    read nothing. Raises ``TransientError`` (no answer, 429, 5xx: retried) or
    ``PermanentError`` (the API off, no such customer, one without a valid email)."""
    customer_id = invoice.provider_customer_id
    if invoice.recipient or not customer_id:
        return
    client = stripe_client()
    if client is None:
        raise PermanentError(NO_RECIPIENT_WITHOUT_API)
    try:
        customer = client.v1.customers.retrieve(customer_id)
    except stripe.StripeError as exc:
        raise stripe_error_sorted(exc, doing=f"reading customer {customer_id}") from exc
    email = customer.to_dict().get("email")
    if not isinstance(email, str) or not email.strip():
        raise RecipientRejected(
            f"invoice has no customer email, nor has its customer {customer_id}: correct the "
            "recipient, then replay"
        )
    email = text_storable(email.strip())
    recipient_address(email=email, name="")  # the send's own rules, before it is kept
    Invoice.objects.filter(pk=invoice.pk, customer_email="").update(customer_email=email)
    invoice.customer_email = email
    logger.info("invoice recipient read from its customer", extra={"invoice_id": invoice.pk})


def _not_paid(invoice_id: int) -> str:
    logger.info("invoice not paid; no email", extra={"invoice_id": invoice_id})
    return "not_paid"


def _invoice_email_send_claimed(
    *, invoice_id: int, key: str, owner: str, breaker: Breaker, decision: Decision
) -> str:
    invoice, claim = email_claim(invoice_id=invoice_id, key=key, owner=owner)
    if invoice.status != Invoice.Status.PAID:
        return _not_paid(invoice_id)
    if claim is None:
        if EmailDelivery.objects.filter(key=key, state=EmailDelivery.State.SENDING).exists():
            # Claimed by a run that looks alive, or by an earlier run of this job that could not
            # release its claim (the database went away): not done until that claim ends.
            raise EmailInProgress(
                f"email {key} is claimed by another run; checked again shortly",
                retry_in=CLAIMED_RECHECK_SECONDS,
                jitter=CLAIMED_RECHECK_SECONDS,
                deadline=4 * settings.EMAIL_CLAIM_LEASE_SECONDS,
            )
        logger.info("invoice email already sent", extra={"invoice_id": invoice_id, "key": key})
        return "skipped"
    # Built under the claim: a process paused here past the lapse sends at most the one
    # duplicate, with the same Message-ID.
    try:
        invoice_recipient_fetch(invoice)
        built = invoice_email_build(invoice=invoice, message_id=claim.message_id, key=key)
        provider_message_id = _deliver(built, breaker=breaker, decision=decision)
    except Exception as exc:
        # Release whatever failed, so a retry or replay can claim again.
        words = isinstance(exc, (PermanentError, TransientError))
        _claim_release(claim, error=str(exc) if words else repr(exc), recipient=invoice.recipient)
        raise
    marked = _claim_mark_sent(
        claim, recipient=invoice.recipient, provider_message_id=provider_message_id
    )
    breaker.record_success()
    sent = {
        "invoice_id": invoice_id,
        "key": key,
        "attempt": claim.attempts,
        "message_id": claim.message_id,
    }
    if marked:
        logger.info("invoice email sent", extra=sent)
    else:
        logger.warning(
            "invoice email sent, but its claim was taken over meanwhile: this send is the "
            "one duplicate, with the same Message-ID",
            extra=sent,
        )
    return "sent"


WORKER_EMAILS_SENT = Counter(
    metric_name("worker_emails_sent"),
    "Emails this worker handed to the SMTP server or provider (runs that returned 'sent').",
    ["task"],
)

EMAIL_QUEUE = "email"
_EMAIL = {
    "queue_name": EMAIL_QUEUE,
    "max_attempts": settings.EMAIL_MAX_ATTEMPTS,
    "backoff": settings.EMAIL_RETRY_BACKOFF_BASE,
    "backoff_max": settings.EMAIL_RETRY_BACKOFF_MAX,
    "time_limit": settings.EMAIL_TASK_SOFT_TIME_LIMIT,
}


def _sent(task_name: str, result: str) -> str:
    if result == "sent":
        WORKER_EMAILS_SENT.labels(task=task_name).inc()
    return result


@task(**_EMAIL)
def send_invoice_email(invoice_id: int) -> str:
    """Email a paid invoice once."""
    result = invoice_email_send(invoice_id=invoice_id, owner=heartbeat_owner())
    return _sent(send_invoice_email.module_path, result)


@task(**_EMAIL)
def resend_invoice_email(delivery_id: int) -> str:
    """Send a deliberate resend, once, under the key its request created."""
    requested = EmailDelivery.objects.filter(pk=delivery_id).first()
    if requested is None:
        raise PermanentError(f"email delivery {delivery_id} does not exist")
    result = invoice_email_send(
        invoice_id=requested.invoice_id, owner=heartbeat_owner(), key=requested.key
    )
    return _sent(resend_invoice_email.module_path, result)
