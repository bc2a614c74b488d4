"""``manage.py outbox relay|status``: publish what the on-commit publish left behind."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from asyncwork.models import OutboxMessage
from asyncwork.outbox import outbox_relay
from asyncwork.settings import asyncwork_settings


class Command(BaseCommand):
    help = "Relay unpublished outbox messages to the broker, or show the backlog."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        relay = sub.add_parser("relay", help="Publish unpublished rows past the grace period.")
        relay.add_argument(
            "--grace",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Only rows older than this (default "
            f"{asyncwork_settings.OUTBOX_RELAY_GRACE_SECONDS}).",
        )
        relay.add_argument("--batch-size", type=int, default=None, metavar="N")
        sub.add_parser("status", help="Count unpublished rows.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "status":
            now = timezone.now()
            backlog = OutboxMessage.objects.waiting(now)
            oldest = backlog.order_by("created_at").values_list("created_at", flat=True).first()
            self.stdout.write(
                f"unpublished: {backlog.count()}"
                + (f" (oldest {oldest:%Y-%m-%d %H:%M:%S})" if oldest else "")
                + f"; retries scheduled for later: {OutboxMessage.objects.scheduled(now).count()}"
            )
            return
        grace, batch = options["grace"], options["batch_size"]
        if grace is not None and grace < 0:
            raise CommandError("--grace must be zero or more seconds")
        if batch is not None and batch < 1:
            raise CommandError("--batch-size must be at least 1")
        published = outbox_relay(
            grace=None if grace is None else timedelta(seconds=grace), batch_size=batch
        )
        remaining = OutboxMessage.objects.waiting(timezone.now()).count()
        self.stdout.write(self.style.SUCCESS(f"published {published}; {remaining} unpublished"))
        if remaining and published == 0 and grace == 0:
            raise CommandError("the broker refused every publish; rows stay for the next run")
