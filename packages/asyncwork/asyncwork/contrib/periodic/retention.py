"""Retention: the ``retention-purge`` job runs, in declaration order, the rules apps declare with
``@retention_rule(name)``. A rule deletes or clears what is past its age batch by batch
(``batched_delete``, ``batched_update``) and is safe to run twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db.models import QuerySet
from django.utils import timezone

from asyncwork.contrib.periodic.jobs import job
from asyncwork.models import Job

logger = logging.getLogger(__name__)

JOB_RETENTION_DAYS = 7  # long enough to trace a recent job: when it ran, how often, what it gave

# now, batch size -> rows purged
Rule = Callable[[datetime, int], int]

_rules: dict[str, Rule] = {}
R = TypeVar("R", bound=Rule)


def retention_rule(name: str) -> Callable[[R], R]:
    """Declare (or replace) rule ``name``: ``rule(now, batch)`` purges what is past its age."""

    def declare(rule: R) -> R:
        _rules[name] = rule
        return rule

    return declare


def batched_delete(queryset: QuerySet[Any], *, batch: int) -> int:
    """Delete the rows of ``queryset``, ``batch`` at a time; returns how many."""
    deleted = 0
    while ids := list(queryset.values_list("pk", flat=True)[:batch]):
        count, _ = queryset.model.objects.filter(pk__in=ids).delete()
        deleted += count
    return deleted


def batched_update(queryset: QuerySet[Any], *, batch: int, **values: Any) -> int:
    """Set ``values`` on the rows of ``queryset``, ``batch`` at a time; the queryset must no
    longer match a row once updated. Returns how many."""
    updated = 0
    while ids := list(queryset.values_list("pk", flat=True)[:batch]):
        updated += queryset.model.objects.filter(pk__in=ids).update(**values)
    return updated


@job("retention-purge", cron={"minute": "17", "hour": "3"})
def retention_purge(*, batch: int = 5000) -> dict[str, int]:
    """Run every declared rule; returns how many rows each touched, by rule name, leaving out the
    rules that touched none (``{}``: nothing to purge, a run logged at DEBUG)."""
    now = timezone.now()
    touched = {name: rule(now, batch) for name, rule in _rules.items()}
    return {name: count for name, count in touched.items() if count}


@retention_rule("jobs")
def jobs_purge(now: datetime, batch: int) -> int:
    """Jobs finished (successful, or failed with their dead letter kept) long ago."""
    finished = Job.objects.filter(
        status__in=[Job.Status.SUCCESSFUL, Job.Status.FAILED],
        finished_at__lt=now - timedelta(days=JOB_RETENTION_DAYS),
    )
    return batched_delete(finished, batch=batch)
