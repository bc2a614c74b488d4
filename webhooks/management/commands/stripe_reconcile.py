"""``manage.py stripe_reconcile [--since WHEN]``: one run of the job ``stripe-events-reconcile``
now, under its lock (``webhooks.reconcile``), and what it found; ``--since`` has the walk list
back to WHEN, within the 30 days Stripe's Events API keeps. Exits 1 when it could not run or
stopped on a failure; a walk that goes on at the next run is not a failure. A failure's words
(Stripe's, or its network's) are printed through ``printable``."""

from __future__ import annotations

from datetime import UTC, datetime, time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from asyncwork.contrib.periodic.jobs import job_run
from asyncwork.deadletters import TIME_FORMS
from asyncwork.logging import printable
from webhooks import reconcile
from webhooks.stripe_api import API_OFF


def _moment(value: str) -> datetime:
    """``value`` in UTC; a date alone is its day's start; without an offset, in the current time
    zone (as ``dlq``'s ``--since``)."""
    text = value.strip()
    try:
        day = parse_date(text)
        moment = datetime.combine(day, time.min) if day else parse_datetime(text)
    except ValueError:  # well formed but no such day or time: 2026-02-30
        moment = None
    if moment is None:
        raise CommandError(f"--since {value!r} is not {TIME_FORMS}")
    return (timezone.make_aware(moment) if timezone.is_naive(moment) else moment).astimezone(UTC)


class Command(BaseCommand):
    help = "Record the events Stripe's Events API has and this application does not, once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            metavar="WHEN",
            help=(
                "List back to WHEN at least, within the "
                f"{reconcile.EVENTS_KEPT.days} days Stripe keeps events: {TIME_FORMS}."
            ),
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.STRIPE_API_KEY:
            raise CommandError(API_OFF)
        since = _moment(options["since"]) if options["since"] is not None else None
        if since is not None and (refused := reconcile.since_refusal(since, now=timezone.now())):
            raise CommandError(refused)
        outcome = job_run(
            name=reconcile.JOB, body=lambda: reconcile.stripe_events_reconcile(since=since)
        )
        if not outcome.ran:
            raise CommandError(
                f"another run of {reconcile.JOB} holds its lock; try again when it ends"
            )
        result = outcome.result
        if not result.calls:
            raise CommandError(printable(result.failure))
        self.stdout.write(
            f"{result.listed} event(s) listed in {result.calls} call(s); "
            f"{result.recovered} recovered (not stored before), "
            f"{result.listed - result.recovered} already stored"
        )
        if result.failure:
            failure = printable(result.failure)
            raise CommandError(f"stopped: {failure}; the next run goes on from there")
        if result.walk_ended:
            self.stdout.write(f"cursor: {result.covered}")
        else:
            self.stdout.write(
                f"the walk back to {result.walk_since:{reconcile.TIME}} UTC goes on at the next "
                f"run (a run makes at most {reconcile.CALLS_PER_RUN} calls)"
            )
