"""``manage.py stripe_reconcile``: one run of the job ``stripe-events-reconcile`` now, under its
lock (``webhooks.reconcile``), and what it found. Exits 1 when it could not run or stopped on a
failure; a walk that goes on at the next run is not a failure. A failure's words (Stripe's, or
its network's) are printed through ``printable``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from asyncwork.jobs import job_run
from asyncwork.terminal import printable
from webhooks import reconcile
from webhooks.stripe_api import API_OFF


class Command(BaseCommand):
    help = "Record the events Stripe's Events API has and this application does not, once."

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.STRIPE_API_KEY:
            raise CommandError(API_OFF)
        outcome = job_run(name=reconcile.JOB, body=reconcile.stripe_events_reconcile)
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
            self.stdout.write(
                f"cursor: every event created before {result.covered_until:%Y-%m-%d %H:%M:%S} "
                "UTC is recorded"
            )
        else:
            self.stdout.write(
                "the walk goes on at the next run "
                f"(a run makes at most {reconcile.CALLS_PER_RUN} calls)"
            )
