"""``manage.py stripe_trigger EVENT_TYPE``: the offline twin of ``stripe trigger``.

Builds a realistic Stripe event of any type the CLI triggers (``webhooks.testing``
``TRIGGER_OBJECTS``; the v1.* ones thin), signs it with ``STRIPE_WEBHOOK_SECRET`` as Stripe does
and POSTs it to the receiver. ``--repeat`` redelivers it freshly signed, as Stripe's retries
are; ``--stale`` signs it older than the tolerance. The receiver's answers are printed through
``printable``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from asyncwork.logging import printable
from webhooks import testing


class Command(BaseCommand):
    help = "Build, sign and POST a realistic Stripe event to the webhook receiver."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "event_type",
            metavar="EVENT_TYPE",
            help="Any type `stripe trigger` knows, e.g. invoice.paid or invoice.voided.",
        )
        parser.add_argument(
            "--url",
            default="http://127.0.0.1:8000/webhooks/stripe/",
            help="The receiver (default: %(default)s).",
        )
        parser.add_argument(
            "--customer-email",
            default=None,
            help=f"The invoice's recipient (default: {testing.DEFAULT_CUSTOMER_EMAIL}).",
        )
        parser.add_argument(
            "--customer-name",
            default=None,
            help="The recipient's display name (default: none with --customer-email, "
            f"else {testing.DEFAULT_CUSTOMER_NAME!r}).",
        )
        parser.add_argument(
            "--invoice-id",
            default=None,
            help="The Stripe invoice id (in_...), so several events can "
            "concern one invoice. Default: a new one.",
        )
        parser.add_argument("--amount", type=int, default=2000, help="Minor units.")
        parser.add_argument("--currency", default="usd")
        parser.add_argument(
            "--repeat",
            type=int,
            default=1,
            metavar="N",
            help="Deliver the same event N times (duplicates).",
        )
        parser.add_argument(
            "--stale", action="store_true", help="Sign with a timestamp older than the tolerance."
        )
        parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["event_type"] not in testing.TRIGGER_OBJECTS:
            known = ", ".join(sorted(testing.TRIGGER_OBJECTS))
            raise CommandError(f"unknown event type {options['event_type']!r}; known: {known}")
        if options["repeat"] < 1:
            raise CommandError("--repeat must be at least 1")
        invoice_id = options["invoice_id"] or testing.new_id("in")
        if not invoice_id.startswith("in_"):
            raise CommandError("--invoice-id must look like a Stripe invoice id (in_...)")
        body = testing.encode(self.build(options["event_type"], invoice_id, options))
        secret = settings.STRIPE_WEBHOOK_SECRETS[0]
        failures = 0
        for attempt in range(1, options["repeat"] + 1):
            timestamp = int(time.time())
            if options["stale"]:
                timestamp -= settings.STRIPE_WEBHOOK_TOLERANCE + 60
            header = testing.signature_header(body, secret, timestamp=timestamp, with_v0=True)
            status, answer = self.post(options["url"], body, header, options["timeout"])
            self.stdout.write(f"delivery {attempt}: {status} {printable(answer)}")
            failures += status != 200
        if failures:
            raise CommandError(f"{failures} of {options['repeat']} deliveries were not accepted")

    @staticmethod
    def build(event_type: str, invoice_id: str, options: dict[str, Any]) -> dict[str, Any]:
        # The default name belongs to the default address: someone else's address gets none.
        name = options["customer_name"]
        if name is None and options["customer_email"] is None:
            name = testing.DEFAULT_CUSTOMER_NAME
        return testing.trigger_event(
            event_type,
            invoice_id=invoice_id,
            customer_email=options["customer_email"] or testing.DEFAULT_CUSTOMER_EMAIL,
            customer_name=name or None,
            amount=options["amount"],
            currency=options["currency"],
        )

    @staticmethod
    def post(url: str, body: bytes, header: str, timeout: float) -> tuple[int | str, str]:
        if not url.startswith(("http://", "https://")):
            raise CommandError("--url must be an http:// or https:// URL")
        request = urllib.request.Request(  # noqa: S310 - scheme checked above
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json; charset=utf-8",
                "Stripe-Signature": header,
                "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - scheme checked above
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            return "unreachable", json.dumps(str(getattr(exc, "reason", exc)))
