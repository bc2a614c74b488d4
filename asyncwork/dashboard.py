"""The operator's dashboard, ``/admin/dashboard/``: the pipeline on one page, each figure linking to
the list it counts.

It reads the probes (``asyncwork.probes``): the machinery's, declared here, and the apps' own.
Each runs bounded; one that fails shows its error and leaves the others shown. Read-only, for
staff who may view the machinery's lists.
"""

from __future__ import annotations

import time
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from asyncwork import queues
from asyncwork.deadletters import duration_short
from asyncwork.models import DeadLetter
from asyncwork.probes import (
    BeatProbe,
    BreakerProbe,
    DlqProbe,
    Figure,
    OutboxProbe,
    QueuesProbe,
    ScheduledJobsProbe,
    beat_probe,
    dashboard_probe,
    dlq_probe,
    outbox_probe,
    probes_read,
    queues_probe,
    scheduled_jobs_probe,
)
from asyncwork.rescue import WorkersProbe, workers_probe

# What a staff user needs to see the dashboard: the lists it summarises.
VIEW_PERMISSIONS = (
    "asyncwork.view_deadletter",
    "asyncwork.view_outboxmessage",
    "asyncwork.view_scheduledjob",
)


def _changelist(model: str, **query: str) -> str:
    url = reverse(f"admin:asyncwork_{model}_changelist")
    return f"{url}?{urlencode(query)}" if query else url


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else duration_short(seconds)


@dashboard_probe("dlq", dlq_probe, title="Dead letters", database=True)
def dlq_figures(probe: DlqProbe) -> list[Figure]:
    waiting = _changelist("deadletter", replayed="no")
    figures = [
        Figure(
            "waiting",
            str(probe.waiting),
            waiting,
            status="degraded" if probe.alerting else "ok",
        ),
        Figure("oldest waiting", _age(probe.oldest_age_seconds), waiting),
    ]
    labels = dict(DeadLetter.Reason.choices)
    for reason, n in probe.waiting_by_reason.items():
        figures.append(
            Figure(
                f"waiting: {labels.get(reason, reason)}",
                str(n),
                _changelist("deadletter", replayed="no", reason=reason),
            )
        )
    return figures


@dashboard_probe("outbox", outbox_probe, title="Outbox backlog", database=True)
def outbox_figures(probe: OutboxProbe) -> list[Figure]:
    unpublished = _changelist("outboxmessage", published="no")
    stale = "failing" if probe.stale else "ok"
    return [
        Figure(
            "unpublished",
            f"{probe.unpublished}{'+' if probe.capped else ''}",
            unpublished,
            status="degraded" if probe.unpublished else "ok",
        ),
        Figure("oldest unpublished", _age(probe.oldest_age_seconds), unpublished, status=stale),
    ]


@dashboard_probe("queues", queues_probe, title="Broker queues", database=False)
def queues_figures(probe: QueuesProbe) -> list[Figure]:
    figures = [Figure(f"waiting on {name}", str(depth)) for name, depth in probe.depths.items()]
    for name, n in (probe.consumers or {}).items():  # RabbitMQ only
        if name != queues.DLQ:  # nobody consumes it
            figures.append(Figure(f"consumers of {name}", str(n), status="ok" if n else "degraded"))
    return figures


@dashboard_probe("beat", beat_probe, title="Beat", database=True)
def beat_figures(probe: BeatProbe) -> list[Figure]:
    return [
        Figure(
            "leader",
            str(probe.active) if probe.active else "none: scheduled jobs are not dispatched",
            reverse("admin:django_celery_beat_periodictask_changelist"),
            status="ok" if probe.active else "degraded",
        )
    ]


@dashboard_probe("workers", workers_probe, title="Workers", database=True)
def workers_figures(probe: WorkersProbe) -> list[Figure]:
    """Worker processes by heartbeat: live ones per host, and lapsed ones, whose claims
    ``workers-rescue`` takes over."""
    figures = [
        Figure(
            "live worker processes",
            str(probe.live),
            status="ok" if probe.live else "degraded",
        )
    ]
    figures += [Figure(f"live on {host}", str(n)) for host, n in probe.live_by_host.items()]
    figures.append(
        Figure(
            f"lapsed (no heartbeat for {_age(probe.lapse_seconds)})",
            str(probe.lapsed),
            status="degraded" if probe.lapsed else "ok",
        )
    )
    return figures


@dashboard_probe("scheduled_jobs", scheduled_jobs_probe, title="Scheduled jobs", database=True)
def scheduled_jobs_figures(probe: ScheduledJobsProbe) -> list[Figure]:
    figures = []
    for job in probe.jobs:
        if job.last_started_at is None:
            value = "never ran"
        else:
            age = (timezone.now() - job.last_started_at).total_seconds()
            value = f"last ran {_age(age)} ago"
        if job.last_error:
            value += ", and failed"
        url = (
            reverse("admin:asyncwork_scheduledjob_change", args=[job.pk])
            if job.pk is not None
            else _changelist("scheduledjob")
        )
        figures.append(Figure(job.name, value, url, status="failing" if job.last_error else "ok"))
    return figures


def breaker_figures(probe: BreakerProbe) -> list[Figure]:
    """Any circuit breaker's figures; an app shows its breaker's probe with these."""
    status = {"closed": "ok", "open": "degraded", "half-open": "degraded"}.get(
        probe.state, "unknown"
    )
    health = reverse("health")
    figures = [Figure("state", probe.state, health, status=status)]
    if probe.failures is not None:
        figures.append(Figure("consecutive failures", str(probe.failures), health))
    if probe.state == "open":
        figures.append(Figure("next probe in", _age(probe.retry_in), health))
    return figures


@never_cache
@require_safe
def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Served through ``admin.site.admin_view`` (staff only; others go to the login page)."""
    if not request.user.has_perms(VIEW_PERMISSIONS):
        raise PermissionDenied
    started = time.perf_counter()
    readings = probes_read()
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "readings": readings,
        "probes_ms": round((time.perf_counter() - started) * 1000, 1),
    }
    return TemplateResponse(request, "admin/asyncwork/dashboard.html", context)
