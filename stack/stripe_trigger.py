"""``python -m stack.stripe_trigger EVENT_TYPE``: the offline twin of ``stripe trigger``.

Builds a realistic Stripe event of any type the CLI triggers (``stack.stripe_events``
``TRIGGER_OBJECTS``; the v1.* ones thin), signs it with ``STRIPE_WEBHOOK_SECRET`` as Stripe does
and POSTs it to the receiver. ``--repeat`` redelivers it freshly signed, as Stripe's retries
are; ``--stale`` signs it older than the tolerance. The receiver's answers are printed through
``printable``.

The secret and the tolerance are the application's settings (``DJANGO_SETTINGS_MODULE``,
``core.settings`` unless set), read as the receiver reads them: in the receiver's environment
the two agree, with no option to pass. Exit status 0 when every delivery was accepted; 1 when
one was not, and for bad input or settings, said in one line on stderr; 2 for argparse's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from asyncwork.logging import printable
from stack import stripe_events

PROG = "python -m stack.stripe_trigger"


class TriggerError(Exception):
    """Bad input, or a delivery not accepted: one line, exit status 1."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Build, sign and POST a realistic Stripe event to the webhook receiver, "
        "signed with the settings' STRIPE_WEBHOOK_SECRET (DJANGO_SETTINGS_MODULE, core.settings "
        "unless set): run it in the receiver's environment.",
    )
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
        help=f"The invoice's recipient (default: {stripe_events.DEFAULT_CUSTOMER_EMAIL}).",
    )
    parser.add_argument(
        "--customer-name",
        default=None,
        help="The recipient's display name (default: none with --customer-email, "
        f"else {stripe_events.DEFAULT_CUSTOMER_NAME!r}).",
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = vars(parser().parse_args(argv))
    try:
        trigger(options)
    except TriggerError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def trigger(options: dict[str, Any]) -> None:
    if options["event_type"] not in stripe_events.TRIGGER_OBJECTS:
        known = ", ".join(sorted(stripe_events.TRIGGER_OBJECTS))
        raise TriggerError(f"unknown event type {options['event_type']!r}; known: {known}")
    if options["repeat"] < 1:
        raise TriggerError("--repeat must be at least 1")
    invoice_id = options["invoice_id"] or stripe_events.new_id("in")
    if not invoice_id.startswith("in_"):
        raise TriggerError("--invoice-id must look like a Stripe invoice id (in_...)")
    if not options["url"].startswith(("http://", "https://")):
        raise TriggerError("--url must be an http:// or https:// URL")
    body = stripe_events.encode(build(options["event_type"], invoice_id, options))
    secret, tolerance = signing_settings()
    failures = 0
    for attempt in range(1, options["repeat"] + 1):
        timestamp = int(time.time())
        if options["stale"]:
            timestamp -= tolerance + 60
        header = stripe_events.signature_header(body, secret, timestamp=timestamp, with_v0=True)
        status, answer = post(options["url"], body, header, options["timeout"])
        print(f"delivery {attempt}: {status} {printable(answer)}", flush=True)
        failures += status != 200
    if failures:
        raise TriggerError(f"{failures} of {options['repeat']} deliveries were not accepted")


def signing_settings() -> tuple[str, int]:
    """The receiver's ``STRIPE_WEBHOOK_SECRET`` (the first, while several are rolled) and
    ``STRIPE_WEBHOOK_TOLERANCE``, from its settings; settings that refuse to load are the
    ``Configuration error`` line every entry point prints, exit status 1."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    try:
        return settings.STRIPE_WEBHOOK_SECRETS[0], settings.STRIPE_WEBHOOK_TOLERANCE
    except ImproperlyConfigured as exc:
        raise SystemExit(f"Configuration error: {exc}") from None


def build(event_type: str, invoice_id: str, options: dict[str, Any]) -> dict[str, Any]:
    # The default name belongs to the default address: someone else's address gets none.
    name = options["customer_name"]
    if name is None and options["customer_email"] is None:
        name = stripe_events.DEFAULT_CUSTOMER_NAME
    return stripe_events.trigger_event(
        event_type,
        invoice_id=invoice_id,
        customer_email=options["customer_email"] or stripe_events.DEFAULT_CUSTOMER_EMAIL,
        customer_name=name or None,
        amount=options["amount"],
        currency=options["currency"],
    )


def post(url: str, body: bytes, header: str, timeout: float) -> tuple[int | str, str]:
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked in trigger
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
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - as above
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return "unreachable", json.dumps(str(getattr(exc, "reason", exc)))


if __name__ == "__main__":
    sys.exit(main())
