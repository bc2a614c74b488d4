"""``manage.py setup_periodic_tasks``: ``schedules_sync``, as ``migrate`` runs it; idempotent."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from asyncwork.contrib.periodic.jobs import schedules_sync, schedules_sync_summary


class Command(BaseCommand):
    help = "Create or update the periodic tasks declared in asyncwork/jobs.py; disable stale ones."

    def handle(self, *args: Any, **options: Any) -> None:
        counts = schedules_sync()
        self.stdout.write(self.style.SUCCESS(schedules_sync_summary(counts=counts)))
