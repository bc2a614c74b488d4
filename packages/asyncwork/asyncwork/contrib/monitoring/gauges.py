"""The machinery's probes (``asyncwork.contrib.monitoring.probes``), each declared once with what
``/health/``,
``/metrics`` and the dashboard make of it, in the order they show it. ``breaker_check``,
``breaker_metrics`` and ``breaker_figures`` are for an app's circuit breaker.

``dlq`` and ``beat`` are not critical to ``/health/``: dead letters are a human's inbox
(``dlq_alert``), and without beat the jobs still run, only the safety nets wait; a 503 would only
pull healthy web processes out of a load balancer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from urllib.parse import urlencode

from django.db import connection
from django.db.models import Count, Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork import broker
from asyncwork.broker import broker_redis
from asyncwork.contrib.backpressure import (
    Pressure,
    QueuesProbe,
    pressure_measure,
    queues_probe,
    rabbitmq_depths,
)
from asyncwork.contrib.monitoring.probes import (
    BreakerProbe,
    CheckResult,
    DlqProbe,
    Figure,
    OutboxProbe,
    Probe,
    dlq_probe,
    outbox_probe,
    probe_declare,
    scheduled_jobs_probe,
)
from asyncwork.contrib.periodic.beat import active_beat
from asyncwork.contrib.periodic.locks import Holder
from asyncwork.deadletters import duration_short
from asyncwork.models import DeadLetter, ScheduledJob, WorkerHeartbeat
from asyncwork.runner import lapse_seconds
from asyncwork.settings import asyncwork_settings, metric_name


def _changelist(model: str, **query: str) -> str:
    url = reverse(f"admin:asyncwork_{model}_changelist")
    return f"{url}?{urlencode(query)}" if query else url


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else duration_short(seconds)


def _database_ping() -> CheckResult:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"status": "ok"}


def _broker_ping() -> CheckResult:
    """Raises when the broker does not answer in time."""
    if broker.rabbitmq():
        rabbitmq_depths((broker.DLQ,))
    elif (client := broker_redis()) is not None:
        client.ping()
    else:
        return {"status": "unknown", "detail": "the broker is neither Redis nor RabbitMQ"}
    return {"status": "ok"}


probe_declare(Probe("database", _database_ping, database=True, check=dict))
probe_declare(Probe("broker", _broker_ping, database=False, check=dict))


def dlq_check(dlq: DlqProbe) -> CheckResult:
    return {
        "status": "degraded" if dlq.alerting else "ok",
        "waiting": dlq.waiting,
        "alert_threshold": asyncwork_settings.DLQ_ALERT_THRESHOLD,
    }


def dlq_metrics(dlq: DlqProbe) -> list[Metric]:
    return [
        GaugeMetricFamily(
            metric_name("dlq_depth"), "Dead letters waiting (not replayed).", value=dlq.waiting
        )
    ]


def dlq_figures(probe: DlqProbe) -> list[Figure]:
    waiting = _changelist("deadletter", replayed="no")
    figures = [
        Figure("waiting", str(probe.waiting), waiting, "degraded" if probe.alerting else "ok"),
        Figure("oldest waiting", _age(probe.oldest_age_seconds), waiting),
    ]
    labels = dict(DeadLetter.Reason.choices)
    for reason, n in probe.waiting_by_reason.items():
        url = _changelist("deadletter", replayed="no", reason=reason)
        figures.append(Figure(f"waiting: {labels.get(reason, reason)}", str(n), url))
    return figures


probe_declare(
    Probe(
        "dlq",
        dlq_probe,
        database=True,
        check=dlq_check,
        critical=False,
        metrics=dlq_metrics,
        title="Dead letters",
        figures=dlq_figures,
    )
)


def outbox_check(outbox: OutboxProbe) -> CheckResult:
    age = outbox.oldest_age_seconds
    return {
        "status": "failing" if outbox.stale else "ok",
        "unpublished": outbox.unpublished,
        "unpublished_capped": outbox.capped,
        "oldest_unpublished_age_seconds": None if age is None else round(age, 1),
        "stale_after_seconds": asyncwork_settings.OUTBOX_STALE_SECONDS,
    }


def outbox_metrics(outbox: OutboxProbe) -> list[Metric]:
    return [
        GaugeMetricFamily(
            metric_name("outbox_backlog"),
            f"Unpublished outbox rows (counted up to BACKPRESSURE_HARD_MARK, {outbox.cap}).",
            value=outbox.unpublished,
        ),
        GaugeMetricFamily(
            metric_name("outbox_oldest_unpublished_age_seconds"),
            "Age of the oldest unpublished outbox row (0 when there is none).",
            value=outbox.oldest_age_seconds or 0.0,
        ),
    ]


def outbox_figures(probe: OutboxProbe) -> list[Figure]:
    unpublished = _changelist("job", status="READY", published_at__isnull="True")
    count = f"{probe.unpublished}{'+' if probe.capped else ''}"
    oldest = _age(probe.oldest_age_seconds)
    return [
        Figure("unpublished", count, unpublished, "degraded" if probe.unpublished else "ok"),
        Figure("oldest unpublished", oldest, unpublished, "failing" if probe.stale else "ok"),
    ]


probe_declare(
    Probe(
        "outbox",
        outbox_probe,
        database=True,
        check=outbox_check,
        metrics=outbox_metrics,
        title="Outbox backlog",
        figures=outbox_figures,
    )
)


def queues_figures(probe: QueuesProbe) -> list[Figure]:
    figures = [Figure(f"waiting on {name}", str(depth)) for name, depth in probe.depths.items()]
    for name, n in (probe.consumers or {}).items():  # RabbitMQ only
        if name != broker.DLQ:  # nobody consumes it
            figures.append(Figure(f"consumers of {name}", str(n), status="ok" if n else "degraded"))
    return figures


probe_declare(
    Probe("queues", queues_probe, database=False, title="Broker queues", figures=queues_figures)
)


def pressure_queues_probe() -> QueuesProbe:
    """The pressure queues only (none declared: none read)."""
    names = broker.pressure()
    return queues_probe(names) if names else QueuesProbe(depths={})


def queue_metrics(probe: QueuesProbe) -> list[Metric]:
    family = GaugeMetricFamily(
        metric_name("broker_queue_depth"),
        "Messages waiting on a broker queue (not those a worker holds).",
        labels=["queue"],
    )
    for name, depth in probe.depths.items():
        family.add_metric([name], depth)
    return [family]


probe_declare(Probe("broker_queues", pressure_queues_probe, database=False, metrics=queue_metrics))


def backpressure_check(pressure: Pressure) -> CheckResult:
    level = pressure.level()
    status = {"normal": "ok", "soft": "degraded", "hard": "failing"}[level]
    if pressure.queue_depth is None and pressure.outbox_backlog is None:
        status = "unknown"
    return {
        "status": status,
        "level": str(level),
        "queue_depth": pressure.queue_depth,
        "outbox_backlog": pressure.outbox_backlog,
        "soft_mark": asyncwork_settings.BACKPRESSURE_SOFT_MARK,
        "hard_mark": asyncwork_settings.BACKPRESSURE_HARD_MARK,
        "queues": list(broker.pressure()),
    }


probe_declare(Probe("backpressure", pressure_measure, database=False, check=backpressure_check))


def beat_check(active: Holder | None) -> CheckResult:
    return {"status": "ok" if active else "degraded", "active": asdict(active) if active else None}


def beat_figures(active: Holder | None) -> list[Figure]:
    return [
        Figure(
            "leader",
            str(active) if active else "none: scheduled jobs are not dispatched",
            reverse("admin:django_celery_beat_periodictask_changelist"),
            "ok" if active else "degraded",
        )
    ]


def beat_metrics(active: Holder | None) -> list[Metric]:
    return [
        GaugeMetricFamily(
            metric_name("beat_leader"),
            "1 while a beat process holds the leader lock (dispatching the scheduled jobs), 0 "
            "when none does.",
            value=1.0 if active else 0.0,
        )
    ]


probe_declare(
    Probe(
        "beat",
        active_beat,
        database=True,
        check=beat_check,
        critical=False,
        metrics=beat_metrics,
        title="Beat",
        figures=beat_figures,
    )
)


@dataclass(frozen=True)
class WorkersProbe:
    """Live worker processes per host, and the lapsed ones still kept."""

    live_by_host: dict[str, int]
    lapsed: int
    lapse_seconds: float

    @property
    def live(self) -> int:
        return sum(self.live_by_host.values())


def workers_probe() -> WorkersProbe:
    """One query, on the database's clock. With rescue off, live means within three heartbeats."""
    lapse = lapse_seconds() or 3 * float(asyncwork_settings.WORKER_HEARTBEAT_SECONDS)
    fresh = Q(beat_at__gte=Now() - timedelta(seconds=lapse))
    rows = (
        WorkerHeartbeat.objects.values("hostname")
        .annotate(live=Count("pk", filter=fresh), lapsed=Count("pk", filter=~fresh))
        .order_by("hostname")
    )
    return WorkersProbe(
        live_by_host={row["hostname"]: row["live"] for row in rows if row["live"]},
        lapsed=sum(row["lapsed"] for row in rows),
        lapse_seconds=lapse,
    )


def workers_figures(probe: WorkersProbe) -> list[Figure]:
    """Live worker processes per host, and lapsed ones (whose claims ``workers-rescue`` takes)."""
    figures = [
        Figure("live worker processes", str(probe.live), status="ok" if probe.live else "degraded")
    ]
    figures += [Figure(f"live on {host}", str(n)) for host, n in probe.live_by_host.items()]
    lapsed = f"lapsed (no heartbeat for {_age(probe.lapse_seconds)})"
    figures.append(Figure(lapsed, str(probe.lapsed), status="degraded" if probe.lapsed else "ok"))
    return figures


def workers_metrics(probe: WorkersProbe) -> list[Metric]:
    """Both series always, 0 included: no live process is the alert."""
    family = GaugeMetricFamily(
        metric_name("worker_processes"),
        "Worker processes by heartbeat: live (beat within the lapse), lapsed (no beat for it, "
        "never stopped cleanly; kept an hour).",
        labels=["state"],
    )
    family.add_metric(["live"], probe.live)
    family.add_metric(["lapsed"], probe.lapsed)
    return [family]


probe_declare(
    Probe(
        "workers",
        workers_probe,
        database=True,
        metrics=workers_metrics,
        title="Workers",
        figures=workers_figures,
    )
)


def scheduled_job_metrics(jobs: tuple[ScheduledJob, ...]) -> list[Metric]:
    runs = CounterMetricFamily(
        metric_name("scheduled_job_runs"),
        "Runs of each scheduled job (it held the lock).",
        labels=["job"],
    )
    skips = CounterMetricFamily(
        metric_name("scheduled_job_skips"),
        "Skipped runs of each scheduled job (another run held the lock).",
        labels=["job"],
    )
    last_run = GaugeMetricFamily(
        metric_name("scheduled_job_last_run_timestamp_seconds"),
        "Unix time the job's last run started (absent before its first run).",
        labels=["job"],
    )
    failed = GaugeMetricFamily(
        metric_name("scheduled_job_last_run_failed"),
        "1 when the job's last finished run raised.",
        labels=["job"],
    )
    for job in jobs:
        runs.add_metric([job.name], job.runs)
        skips.add_metric([job.name], job.skips)
        failed.add_metric([job.name], 1.0 if job.last_error else 0.0)
        if job.last_started_at is not None:
            last_run.add_metric([job.name], job.last_started_at.timestamp())
    return [runs, skips, last_run, failed]


def scheduled_jobs_figures(jobs: tuple[ScheduledJob, ...]) -> list[Figure]:
    figures = []
    for job in jobs:
        if job.last_started_at is None:
            value = "never ran"
        else:
            value = f"last ran {_age((timezone.now() - job.last_started_at).total_seconds())} ago"
        if job.last_error:
            value += ", and failed"
        url = (
            reverse("admin:asyncwork_scheduledjob_change", args=[job.pk])
            if job.pk is not None
            else _changelist("scheduledjob")
        )
        figures.append(Figure(job.name, value, url, "failing" if job.last_error else "ok"))
    return figures


probe_declare(
    Probe(
        "scheduled_jobs",
        scheduled_jobs_probe,
        database=True,
        metrics=scheduled_job_metrics,
        title="Scheduled jobs",
        figures=scheduled_jobs_figures,
    )
)


def breaker_check(breaker: BreakerProbe) -> CheckResult:
    return {"status": breaker.status, **asdict(breaker)}


BREAKER_STATES = ("closed", "open", "half-open", "unknown")


def breaker_metrics(breaker: BreakerProbe) -> list[Metric]:
    """A breaker's state (one series per state, 1 for the current; ``unknown`` when Redis does not
    answer) and its consecutive failures."""
    states = GaugeMetricFamily(
        metric_name("breaker_state"),
        "Circuit breaker state: 1 for the current state, 0 for the others.",
        labels=["breaker", "state"],
    )
    for name in BREAKER_STATES:
        states.add_metric([breaker.name, name], 1.0 if breaker.state == name else 0.0)
    families: list[Metric] = [states]
    if breaker.failures is not None:
        failures = GaugeMetricFamily(
            metric_name("breaker_consecutive_failures"),
            "Consecutive failures the breaker has counted.",
            labels=["breaker"],
        )
        failures.add_metric([breaker.name], breaker.failures)
        families.append(failures)
    return families


def breaker_figures(probe: BreakerProbe) -> list[Figure]:
    health = reverse("health")
    figures = [Figure("state", probe.state, health, probe.status)]
    if probe.failures is not None:
        figures.append(Figure("consecutive failures", str(probe.failures), health))
    if probe.state == "open":
        figures.append(Figure("next probe in", _age(probe.retry_in), health))
    return figures
