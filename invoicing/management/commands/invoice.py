"""``manage.py invoice show|recipient INVOICE``, ``manage.py invoice open``: an invoice from the
command line.

INVOICE is the invoice's id, its provider's id (``in_...``) or its number; one that names no
invoice, or more than one, is refused with the candidates. ``show`` prints where the invoice's
emails go and each email's and dead letter's state. ``recipient`` corrects where they go through the
admin's and the API's service (the send's own rules, a reason, recorded as an operator action of
``cli:<--actor or login name>``); the same correction again changes nothing and exits 0. ``open``
makes an open invoice under a provider's id (``in_...``, a new one unless given), as Stripe's events
would have stored it before a payment, and prints its ids: what ``python -m stack.stripe_trigger
invoice.voided --invoice-id in_...`` then acts on, to try a webhook handler locally (Stripe knows
nothing of it). Whatever it prints that was stored or given passes through ``printable``.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError
from django.db.models import Q
from django.utils import timezone

from asyncwork import deadletters
from asyncwork.audit import cli_actor, cli_actor_argument
from asyncwork.logging import printable
from invoicing.models import EmailDelivery, Invoice
from invoicing.selectors import invoice_dead_letters
from invoicing.services import (
    RecipientUnchanged,
    invoice_open,
    invoice_recipient_correct,
    recipient_now,
)
from invoicing.tasks import amount_minor, format_amount
from webhooks.stripe import name_valid

INVOICE_HELP = "The invoice's id, its provider's id (in_...) or its number."


def invoice_named(name: str) -> Invoice:
    """The one invoice whose id, provider's id or number is ``name``, else ``CommandError``."""
    name = name.strip()
    named = Q(provider_invoice_id=name) | Q(number=name)
    if name.isascii() and name.isdigit():
        named |= Q(pk=int(name))
    found = list(Invoice.objects.filter(named).order_by("pk")[:10])
    if not found:
        raise CommandError(f"no invoice has the id, provider's id or number {name!r}")
    if len(found) > 1:
        candidates = "; ".join(
            f"id {x.pk} (provider's id {_shown(x.provider_invoice_id)}, number {_shown(x.number)})"
            for x in found
        )
        raise CommandError(f"{name!r} names more than one invoice: {candidates}; give its id")
    return found[0]


def _shown(value: str) -> str:
    """Stored text as it can be read on a terminal (``printable``: a provider's address may hold
    a line break or an escape sequence), ``-`` if empty."""
    return printable(value) if value else "-"


def _when(moment: Any) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M %Z")


def email_line(delivery: EmailDelivery) -> str:
    parts = [f"{delivery.pk}", _shown(delivery.state)]
    if delivery.sent_at is not None:
        parts.append(f"at {_when(delivery.sent_at)}")
    parts.append(f"{delivery.attempts} attempt(s)")
    parts.append(f"key {_shown(delivery.key)}")
    if delivery.requested_by:
        parts.append(f"requested by {_shown(delivery.requested_by)}")
    if delivery.last_error:
        parts.append(f"last error: {_shown(' '.join(delivery.last_error.split()))}")
    return "  " + ", ".join(parts)


class Command(BaseCommand):
    help = "Show an invoice, correct where its emails go, or make an open one to try a handler."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        show = sub.add_parser(
            "show",
            help="Where the invoice's emails go, and each email's and dead letter's state.",
        )
        show.add_argument("invoice", metavar="INVOICE", help=INVOICE_HELP)
        recipient = sub.add_parser(
            "recipient",
            help="Correct where the invoice's emails go, saying why.",
            description="Send the invoice's emails to another address from now on (--email), "
            "or to the provider's again (--clear). The provider's next event does not undo it. "
            "Sends nothing: replay the invoice's dead letter or resend its email afterwards.",
        )
        recipient.add_argument("invoice", metavar="INVOICE", help=INVOICE_HELP)
        to = recipient.add_mutually_exclusive_group(required=True)
        to.add_argument("--email", metavar="ADDRESS", help="The address to send to.")
        to.add_argument(
            "--clear",
            action="store_true",
            help="Remove the correction: the provider's address again.",
        )
        recipient.add_argument(
            "--why", required=True, metavar="REASON", help="Why, for the record (a ticket)."
        )
        cli_actor_argument(recipient)
        opened = sub.add_parser(
            "open",
            help="Make an open invoice (a new in_... id) for a webhook event to act on locally.",
            description="Make an open invoice, as Stripe's events would have stored it before "
            "a payment, under a new provider's id; print its id and provider's id. Then "
            "python -m stack.stripe_trigger invoice.voided --invoice-id in_... acts on it. Stripe "
            "knows nothing of it: for trying a handler on a development machine.",
        )
        opened.add_argument(
            "--customer-email", required=True, metavar="ADDRESS", help="The invoice's recipient."
        )
        opened.add_argument(
            "--amount", required=True, metavar="AMOUNT", help="In the currency's unit: 12.34."
        )
        opened.add_argument(
            "--currency", default="usd", metavar="CODE", help="Default: %(default)s."
        )
        opened.add_argument("--customer-name", default="", metavar="NAME")
        opened.add_argument(
            "--invoice-id",
            default=None,
            metavar="in_...",
            help="The provider's id to give it, as stripe_trigger's --invoice-id. Default: a new "
            "one.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        getattr(self, f"_{options['action']}")(options)

    def _open(self, options: dict[str, Any]) -> None:
        currency = options["currency"].strip()
        provider_id = (options["invoice_id"] or f"in_{secrets.token_hex(12)}").strip()
        if not (provider_id.startswith("in_") and name_valid(provider_id)):
            raise CommandError(f"--invoice-id {printable(provider_id)!r} is not an in_... id")
        try:
            invoice = invoice_open(
                provider_invoice_id=provider_id,
                customer_email=options["customer_email"].strip(),
                customer_name=options["customer_name"].strip(),
                amount=amount_minor(options["amount"], currency),
                currency=currency,
            )
        except ValueError as exc:
            raise CommandError(printable(str(exc))) from exc
        except IntegrityError as exc:  # the provider's id is UNIQUE
            taken = Invoice.objects.get(provider_invoice_id=provider_id)
            raise CommandError(f"invoice {provider_id} exists already (id {taken.pk})") from exc
        self.stdout.write(
            f"Invoice open: id {invoice.pk}, provider's id {invoice.provider_invoice_id}, "
            f"{format_amount(invoice.amount_paid, invoice.currency)} to {_shown(invoice.recipient)}"
        )

    def _show(self, options: dict[str, Any]) -> None:
        invoice = invoice_named(options["invoice"])
        status = f"{invoice.status}, {format_amount(invoice.amount_paid, invoice.currency)}"
        if invoice.paid_at is not None:
            status += f", paid at {_when(invoice.paid_at)}"
        self.stdout.write(
            f"Invoice {_shown(str(invoice))} (id {invoice.pk}, "
            f"provider's id {_shown(invoice.provider_invoice_id)})"
        )
        for label, value in (
            ("Status", _shown(status)),
            ("Provider's address", _shown(invoice.customer_email)),
            ("Correction", _shown(invoice.recipient_override)),
            ("Emails go to", _shown(invoice.recipient)),
        ):
            self.stdout.write(f"  {label + ':':<20} {value}")
        emails = list(invoice.emails.order_by("pk"))
        self.stdout.write(f"Emails: {len(emails)}" if emails else "Emails: none")
        for delivery in emails:
            self.stdout.write(email_line(delivery))
        letters = list(invoice_dead_letters(invoice))
        self.stdout.write(f"Dead letters: {len(letters)}" if letters else "Dead letters: none")
        for letter in letters:
            self.stdout.write(
                f"  {letter.pk}, {_shown(deadletters.replay_state(letter))}: "
                f"{_shown(deadletters.failure(letter))}"
            )

    def _recipient(self, options: dict[str, Any]) -> None:
        invoice = invoice_named(options["invoice"])
        email = "" if options["clear"] else options["email"].strip()
        if not options["clear"] and not email:
            raise CommandError("--email is empty: give the address, or --clear")
        try:
            invoice = invoice_recipient_correct(
                invoice_id=invoice.pk,
                email=email,
                reason=options["why"],
                actor=cli_actor(options["actor"]),
            )
        except RecipientUnchanged as exc:  # a repeat of a correction that was done
            unchanged = printable(str(exc))
            self.stdout.write(f"Invoice {_shown(str(invoice))}: nothing changed: {unchanged}")
            return
        except ValueError as exc:
            raise CommandError(printable(str(exc))) from exc
        now = _shown(recipient_now(invoice))
        self.stdout.write(self.style.SUCCESS(f"Invoice {_shown(str(invoice))}: {now}."))
        waiting = [
            str(letter.pk)
            for letter in invoice_dead_letters(invoice)
            if letter.replayed_at is None and letter.resolved_at is None
        ]
        if waiting:
            self.stdout.write(
                f"Nothing was sent: replay its dead letter with manage.py dlq replay "
                f"{' '.join(waiting)}"
            )
        else:
            self.stdout.write("Nothing was sent; no dead letter of it waits.")
