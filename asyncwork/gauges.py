"""The machinery's probes (``asyncwork.probes``) as Prometheus families: ``/metrics`` sources, first
in the exposition. ``breaker_metrics`` is for an app to register for its own breaker.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork import queues
from asyncwork.metrics import metrics_source
from asyncwork.probes import (
    BreakerProbe,
    dlq_probe,
    outbox_probe,
    queues_probe,
    scheduled_jobs_probe,
)


@metrics_source("outbox", database=True)
def outbox_metrics() -> list[Metric]:
    outbox = outbox_probe()
    return [
        GaugeMetricFamily(
            "invoicing_outbox_backlog",
            f"Unpublished outbox rows (counted up to BACKPRESSURE_HARD_MARK, {outbox.cap}).",
            value=outbox.unpublished,
        ),
        GaugeMetricFamily(
            "invoicing_outbox_oldest_unpublished_age_seconds",
            "Age of the oldest unpublished outbox row (0 when there is none).",
            value=outbox.oldest_age_seconds or 0.0,
        ),
    ]


@metrics_source("dlq", database=True)
def dlq_metrics() -> list[Metric]:
    return [
        GaugeMetricFamily(
            "invoicing_dlq_depth", "Dead letters waiting (not replayed).", value=dlq_probe().waiting
        )
    ]


@metrics_source("scheduled_jobs", database=True)
def scheduled_job_metrics() -> list[Metric]:
    runs = CounterMetricFamily(
        "invoicing_scheduled_job_runs",
        "Runs of each scheduled job (it held the lock).",
        labels=["job"],
    )
    skips = CounterMetricFamily(
        "invoicing_scheduled_job_skips",
        "Skipped runs of each scheduled job (another run held the lock).",
        labels=["job"],
    )
    last_run = GaugeMetricFamily(
        "invoicing_scheduled_job_last_run_timestamp_seconds",
        "Unix time the job's last run started (absent before its first run).",
        labels=["job"],
    )
    failed = GaugeMetricFamily(
        "invoicing_scheduled_job_last_run_failed",
        "1 when the job's last finished run raised.",
        labels=["job"],
    )
    for job in scheduled_jobs_probe().jobs:
        runs.add_metric([job.name], job.runs)
        skips.add_metric([job.name], job.skips)
        failed.add_metric([job.name], 1.0 if job.last_error else 0.0)
        if job.last_started_at is not None:
            last_run.add_metric([job.name], job.last_started_at.timestamp())
    return [runs, skips, last_run, failed]


@metrics_source("broker_queues", database=False)
def queue_metrics() -> list[Metric]:
    family = GaugeMetricFamily(
        "invoicing_broker_queue_depth",
        "Messages waiting on a broker queue (not those a worker holds).",
        labels=["queue"],
    )
    names = queues.pressure_queues()
    if names:
        for name, depth in queues_probe(names).depths.items():
            family.add_metric([name], depth)
    return [family]


BREAKER_STATES = ("closed", "open", "half-open", "unknown")


def breaker_metrics(breaker: BreakerProbe) -> list[Metric]:
    """A breaker's state (one series per state, 1 for the current; ``unknown`` when Redis does not
    answer) and its consecutive failures."""
    states = GaugeMetricFamily(
        "invoicing_breaker_state",
        "Circuit breaker state: 1 for the current state, 0 for the others.",
        labels=["breaker", "state"],
    )
    for name in BREAKER_STATES:
        states.add_metric([breaker.name, name], 1.0 if breaker.state == name else 0.0)
    families: list[Metric] = [states]
    if breaker.failures is not None:
        failures = GaugeMetricFamily(
            "invoicing_breaker_consecutive_failures",
            "Consecutive failures the breaker has counted.",
            labels=["breaker"],
        )
        failures.add_metric([breaker.name], breaker.failures)
        families.append(failures)
    return families
