"""``manage.py setup_periodic_tasks``: sync the schedules declared in ``core.jobs.SCHEDULES``
into django-celery-beat's tables (``core.jobs.schedules_sync``, which ``manage.py migrate`` also
runs). Idempotent: run it whenever you like."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from core.jobs import schedules_sync, schedules_sync_summary


class Command(BaseCommand):
    help = "Create or update the periodic tasks declared in core/jobs.py; disable stale ones."

    def handle(self, *args: Any, **options: Any) -> None:
        counts = schedules_sync()
        self.stdout.write(self.style.SUCCESS(schedules_sync_summary(counts=counts)))
