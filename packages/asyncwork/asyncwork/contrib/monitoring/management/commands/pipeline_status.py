"""``manage.py pipeline_status``: the pipeline on one screen: the checks of ``GET /health/``, every
queue's depth, each scheduled job's last run, skip and lock holder. Exits 1 when a critical check
fails. What was stored (a job's last error, a lock holder's host) passes through ``printable``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.serializers.json import DjangoJSONEncoder

from asyncwork import broker
from asyncwork.contrib.backpressure import BrokerUnreadable, queues_probe
from asyncwork.contrib.monitoring.health import health_report
from asyncwork.contrib.periodic.jobs import jobs_declared
from asyncwork.contrib.periodic.locks import Holder, lock_holder
from asyncwork.logging import printable
from asyncwork.models import ScheduledJob


def _queue_depths() -> dict[str, int | str]:
    names = broker.watched()
    try:
        return dict(queues_probe(names).depths)
    except (BrokerUnreadable, ValueError) as exc:
        return dict.fromkeys(names, f"unknown ({type(exc).__name__})")


def _jobs() -> list[dict[str, Any]]:
    rows = {job.name: job for job in ScheduledJob.objects.all()}
    report = []
    for schedule in jobs_declared():
        job = rows.get(schedule.name) or ScheduledJob(name=schedule.name)  # all zeros
        holder = lock_holder(f"job:{schedule.name}")
        report.append(
            {
                "job": schedule.name,
                "last_run": job.last_started_at,
                "last_skip": job.last_skipped_at,
                "runs": job.runs,
                "skips": job.skips,
                "running_now": asdict(holder) if holder else None,
                "last_error": job.last_error[:60] or None,
            }
        )
    return report


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _process(holder: dict[str, Any] | None) -> str:
    """``{"host": h, "pid": n}`` as the operator reads it: the process to look at."""
    return printable(str(Holder(**holder))) if holder else "-"


def _figures(name: str, check: dict[str, Any]) -> str:
    if name == "beat" and "active" in check:
        active = check["active"]
        return f"dispatching, {_process(active)}" if active else "no beat is dispatching"
    return printable(
        ", ".join(
            f"{k}={v}"
            for k, v in check.items()
            if k not in {"status", "critical", "ms"} and v is not None
        )
    )


class Command(BaseCommand):
    help = "Show outbox backlog, queue depths, DLQ depth, breaker, active beat and jobs."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args: Any, **options: Any) -> None:
        healthy, report = health_report()
        status = {"health": report, "queues": _queue_depths(), "jobs": _jobs()}
        if options["json"]:
            self.stdout.write(json.dumps(status, cls=DjangoJSONEncoder, indent=2))
        else:
            self._print(status)
        if not healthy:
            raise CommandError(f"failing: {', '.join(report['failing'])}")

    def _print(self, status: dict[str, Any]) -> None:
        health = status["health"]
        checks = health["checks"]
        out = self.stdout.write
        out(f"pipeline: {health['status'].upper()}")
        width = max(map(len, checks), default=0)
        for name, check in checks.items():
            out(f"  {name:<{width}} {check['status']:<9} {_figures(name, check)}")
        out("queues: " + ", ".join(f"{q}={n}" for q, n in status["queues"].items()))
        jobs = max((len(job["job"]) for job in status["jobs"]), default=3)
        out(
            f"{'job':<{jobs}} {'last run':<20} {'last skip':<20} {'runs':>5} {'skips':>5}  "
            "lock held by"
        )
        for job in status["jobs"]:
            out(
                f"{job['job']:<{jobs}} {_when(job['last_run']):<20} {_when(job['last_skip']):<20} "
                f"{job['runs']:>5} {job['skips']:>5}  {_process(job['running_now'])}"
                + (f"  error: {printable(job['last_error'])}" if job["last_error"] else "")
            )
