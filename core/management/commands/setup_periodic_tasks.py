"""``manage.py setup_periodic_tasks``: sync the schedules declared in ``core.jobs.SCHEDULES``
into django-celery-beat's tables. Idempotent: run it on every deploy."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from core.db import insert_or_skip
from core.jobs import SCHEDULES
from core.models import ScheduledJob

MANAGED = "Managed by manage.py setup_periodic_tasks (core/jobs.py)."


class Command(BaseCommand):
    help = "Create or update the periodic tasks declared in core/jobs.py; disable stale ones."

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        counts = {"created": 0, "updated": 0, "unchanged": 0, "disabled": 0}
        for schedule in SCHEDULES:
            fields: dict[str, Any] = {
                "task": schedule.task,
                "enabled": True,
                "description": MANAGED,
                "expire_seconds": schedule.expires,
                "args": json.dumps([]),
                "interval": None,
                "crontab": None,
            }
            if schedule.every is not None:
                fields["interval"], _ = IntervalSchedule.objects.get_or_create(
                    every=int(schedule.every.total_seconds()), period=IntervalSchedule.SECONDS
                )
            elif schedule.cron is not None:
                fields["crontab"], _ = CrontabSchedule.objects.get_or_create(
                    timezone="UTC", **schedule.cron
                )
            task = PeriodicTask.objects.filter(name=schedule.name).first()
            if task is None:
                PeriodicTask.objects.create(name=schedule.name, **fields)
                counts["created"] += 1
            elif any(getattr(task, k) != v for k, v in fields.items()):
                for key, value in fields.items():
                    setattr(task, key, value)
                task.save()
                counts["updated"] += 1
            else:
                counts["unchanged"] += 1
            insert_or_skip(ScheduledJob(name=schedule.name), conflict_fields=["name"])
        declared = {s.name for s in SCHEDULES}
        stale = PeriodicTask.objects.filter(description=MANAGED, enabled=True).exclude(
            name__in=declared
        )
        for task in stale:
            task.enabled = False
            task.save()
            counts["disabled"] += 1
        self.stdout.write(
            self.style.SUCCESS(
                "periodic tasks: " + ", ".join(f"{n} {k}" for k, n in counts.items())
            )
        )
