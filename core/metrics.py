"""Prometheus metrics: what each process exposes, and why there.

Two kinds of figures, kept apart because they live in different places:

**State, computed at scrape time** (``StateCollector``, served only by the web process at
``GET /metrics``). Read from PostgreSQL and Redis when Prometheus asks, so they are exact
whichever process (or host) did the work, and survive every restart: the outbox backlog and
the age of its oldest unpublished row, the dead-letter depth, the email queue's depth on the
broker, each scheduled job's runs, skips and last run (``ScheduledJob``), and, registered by
the ``invoicing`` app, emails sent and send attempts (``EmailDelivery``) and the email
provider's circuit breaker. Each source runs in its own transaction under a statement timeout
of ``PROBE_TIMEOUT_SECONDS``; a source that fails or times out is left out of that scrape and
reported as ``invoicing_metrics_source_up{source} 0`` (after a database error the remaining
database sources are skipped, so a dead database costs one connect timeout, not one each).
``/metrics`` never answers 500. Each state source reads its subsystem's probe
(``core.probes``), the functions ``/health/`` and the admin dashboard read too.

**Events, counted where they happen** (prometheus-client counters and a histogram):

* web process: webhook deliveries by outcome, and outbox publishes (latency from the row's
  creation to its publish, and failures). gunicorn runs several worker processes: with
  ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus-client keeps every process's values in
  memory-mapped files there and ``/metrics`` sums them (``MultiProcessCollector``); without it
  (``runserver``, tests) the default registry of the one process is served.
* Celery workers (other processes, possibly other hosts): task starts, attempts by outcome
  (success, retry, deferred, failure, rejected), emails sent, and the outbox publishes they
  make (the relay job, dead-letter copies), counted by Celery signal receivers. With
  ``WORKER_METRICS_PORT`` set, the worker's main process serves them over HTTP on that port
  (``start_http_server``). Under the prefork pool the tasks run in child processes, so the
  counts must be shared: the worker then requires ``PROMETHEUS_MULTIPROC_DIR`` (a directory of
  its own, not the web's; the main process empties it at start, before the pool forks) and
  serves the sum over all its children, dead ones included, so a recycled child
  (``worker_max_tasks_per_child``) loses nothing. One scrape target per worker host, whatever
  its concurrency. The threads and solo pools count in the one process and need no directory.

The event counters are per process group and restart from zero with it (Prometheus'
``rate()`` handles that); the exact totals are the state figures.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from core.probes import BreakerProbe

logger = logging.getLogger(__name__)

# --- Event counters ---------------------------------------------------------------------------
# Every metric here has labels: a labelled metric creates no value (and, in multiprocess
# mode, no file) until it is first used, so importing this module writes nothing.

WEBHOOK_DELIVERIES = Counter(
    "invoicing_webhook_deliveries",
    "Webhook deliveries by outcome: accepted, duplicate, rejected (reason: why), throttled, "
    "shed (reason: backpressure level), unavailable (database down).",
    ["outcome", "reason"],
)
OUTBOX_PUBLISH_LATENCY = Histogram(
    "invoicing_outbox_publish_latency_seconds",
    "Seconds from an outbox row's creation to its publish to the broker.",
    ["queue"],
    # On-commit publishes take milliseconds; the relay's come after its grace period.
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
)
OUTBOX_PUBLISH_FAILURES = Counter(
    "invoicing_outbox_publish_failures",
    "Outbox publishes that failed (broker down or stalled); the relay retries the row.",
    ["queue"],
)
TASK_STARTS = Counter(
    "invoicing_task_starts", "Task runs started by this worker, by task.", ["task"]
)
TASK_ATTEMPTS = Counter(
    "invoicing_task_attempts",
    "Task runs finished by this worker, by task and outcome: success, retry (a transient "
    "failure, retried), deferred (dependency down; no attempt spent), failure "
    "(dead-lettered), rejected (requeued).",
    ["task", "outcome"],
)
WORKER_EMAILS_SENT = Counter(
    "invoicing_worker_emails_sent",
    "Emails this worker handed to the SMTP server (task runs that returned 'sent').",
    ["task"],
)

# Each series' child, looked up once (``labels()`` costs more than the increment). Filled on
# first use, not at import: a child is a value, and in multiprocess mode a file.
_webhook_series: dict[tuple[str, str], Any] = {}


def webhook_delivery_count(outcome: str, reason: str = "") -> None:
    """One webhook delivery answered with ``outcome`` (reasons are fixed strings)."""
    child = _webhook_series.get((outcome, reason))
    if child is None:
        child = _webhook_series.setdefault(
            (outcome, reason), WEBHOOK_DELIVERIES.labels(outcome=outcome, reason=reason)
        )
    child.inc()


def outbox_published(*, queue: str, created_at: Any) -> None:
    OUTBOX_PUBLISH_LATENCY.labels(queue=queue).observe(
        max(0.0, (timezone.now() - created_at).total_seconds())
    )


def outbox_publish_failed(*, queue: str) -> None:
    OUTBOX_PUBLISH_FAILURES.labels(queue=queue).inc()


# --- Scrape-time state ------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    fn: Callable[[], Iterable[Metric]]
    database: bool


_sources: dict[str, Source] = {}


def register_source(name: str, fn: Callable[[], Iterable[Metric]], *, database: bool) -> None:
    """Add a scrape-time source to ``/metrics`` (or replace the one of that name). A
    ``database`` source runs in a transaction bounded by ``PROBE_TIMEOUT_SECONDS``."""
    _sources[name] = Source(name=name, fn=fn, database=database)


def outbox_metrics() -> list[Metric]:
    from core.probes import outbox_probe

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


def dlq_metrics() -> list[Metric]:
    from core.probes import dlq_probe

    return [
        GaugeMetricFamily(
            "invoicing_dlq_depth", "Dead letters waiting (not replayed).", value=dlq_probe().waiting
        )
    ]


def scheduled_job_metrics() -> list[Metric]:
    from core.probes import scheduled_jobs_probe

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


def email_queue_metrics() -> list[Metric]:
    from core import queues
    from core.probes import queues_probe

    family = GaugeMetricFamily(
        "invoicing_broker_queue_depth",
        "Messages waiting on a broker queue (not those a worker holds).",
        labels=["queue"],
    )
    family.add_metric([queues.EMAIL], queues_probe((queues.EMAIL,)).depths[queues.EMAIL])
    return [family]


BREAKER_STATES = ("closed", "open", "half-open", "unknown")


def breaker_metrics(breaker: BreakerProbe) -> list[Metric]:
    """A circuit breaker's state (one series per state, 1 for the current one; ``unknown``
    when Redis does not answer) and its consecutive failures."""
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


register_source("outbox", outbox_metrics, database=True)
register_source("dlq", dlq_metrics, database=True)
register_source("scheduled_jobs", scheduled_job_metrics, database=True)
register_source("email_queue", email_queue_metrics, database=False)


class StateCollector:
    """Runs every registered source at scrape time; see the module docstring."""

    def collect(self) -> Iterable[Metric]:
        from core.probes import bounded

        started = time.perf_counter()
        up = GaugeMetricFamily(
            "invoicing_metrics_source_up",
            "1 when the source answered in this scrape, 0 when it failed or was skipped.",
            labels=["source"],
        )
        database_failed = False
        for source in list(_sources.values()):
            if source.database and database_failed:
                up.add_metric([source.name], 0.0)
                continue
            try:
                if source.database:
                    with bounded():
                        families = list(source.fn())
                else:
                    families = list(source.fn())
            except Exception as exc:  # noqa: BLE001 - a failing source is left out, never a 500
                database_failed = database_failed or (
                    source.database and isinstance(exc, DatabaseError)
                )
                logger.warning("metrics source %s failed: %r", source.name, exc)
                up.add_metric([source.name], 0.0)
                continue
            up.add_metric([source.name], 1.0)
            yield from families
        yield up
        yield GaugeMetricFamily(
            "invoicing_metrics_scrape_duration_seconds",
            "Seconds the scrape-time sources took.",
            value=time.perf_counter() - started,
        )


_state_registry = CollectorRegistry(auto_describe=False)
_state_registry.register(StateCollector())


def _event_registry() -> CollectorRegistry:
    """This process group's event counters: summed over the processes sharing
    ``PROMETHEUS_MULTIPROC_DIR`` when it is set, else this process's own."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def metrics_exposition() -> bytes:
    """The text exposition of ``/metrics``: event counters, then scrape-time state."""
    return generate_latest(_event_registry()) + generate_latest(_state_registry)


# --- The view -----------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _networks(
    entries: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def metrics_token_presented(request: HttpRequest) -> bool:
    """True when ``METRICS_TOKEN`` is set and the request carries it as ``Authorization:
    Bearer <token>`` (compared in constant time). It opens ``/metrics`` and the details of
    ``/health/``."""
    token = settings.METRICS_TOKEN
    if not token:
        return False
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and constant_time_compare(given.strip(), token)


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """Who may read /metrics: with ``METRICS_TOKEN`` set, whoever presents it as a bearer
    token; otherwise a client inside ``METRICS_ALLOWED_NETWORKS``, judged on the address the
    webhook throttle uses (the socket's, or through ``NUM_PROXIES`` trusted proxies). With
    ``NUM_PROXIES`` 0, a request carrying ``X-Forwarded-For`` came through a proxy the app
    does not know, whose own (internal) address says nothing about the client: refused."""
    if settings.METRICS_TOKEN:
        if metrics_token_presented(request):
            return None
        response = HttpResponse("bearer token required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    forbidden = HttpResponse("forbidden\n", status=403, content_type="text/plain")
    if settings.NUM_PROXIES == 0 and "HTTP_X_FORWARDED_FOR" in request.META:
        return forbidden
    from rest_framework.request import Request
    from rest_framework.throttling import BaseThrottle

    try:
        address = ipaddress.ip_address(BaseThrottle().get_ident(cast(Request, request)) or "")
    except ValueError:
        return forbidden
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    if any(address in network for network in _networks(tuple(settings.METRICS_ALLOWED_NETWORKS))):
        return None
    return forbidden


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    try:
        response = HttpResponse(metrics_exposition(), content_type=CONTENT_TYPE_LATEST)
    except Exception:  # a scrape that cannot be served is a 503, never a 500
        logger.exception("metrics exposition failed")
        response = HttpResponse("metrics unavailable\n", status=503, content_type="text/plain")
    response["Cache-Control"] = "no-store"
    return response


# --- Celery ---------------------------------------------------------------------------------------

_OUTCOMES = {
    "SUCCESS": "success",
    "RETRY": "retry",
    "FAILURE": "failure",
    "REJECTED": "rejected",
    "IGNORED": "ignored",
}


def _task_name(task: Any) -> str:
    return str(getattr(task, "name", None) or "unknown")


def _task_started(task: Any = None, **_: Any) -> None:
    TASK_STARTS.labels(task=_task_name(task)).inc()


def _task_finished(
    task: Any = None, retval: Any = None, state: str | None = None, **_: Any
) -> None:
    """``task_postrun`` sees every finished run with its final state, including a ``Reject``
    (which no outcome signal reports); a deferral is a retry whose cause is ``Deferred``."""
    from core.tasks import Deferred

    name = _task_name(task)
    outcome = _OUTCOMES.get(state or "", "unknown")
    if outcome == "retry" and isinstance(getattr(retval, "exc", None), Deferred):
        outcome = "deferred"
    TASK_ATTEMPTS.labels(task=name, outcome=outcome).inc()
    if outcome == "success" and retval == "sent":
        WORKER_EMAILS_SENT.labels(task=name).inc()


def multiprocess_dir_reset(directory: str | None = None) -> None:
    """Empty ``PROMETHEUS_MULTIPROC_DIR`` (creating it if needed): counts left by an earlier
    run must not be added to this one's. Call it once, in the parent, before workers fork."""
    directory = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)


_serving: list[int] = []


def _worker_metrics_serve(sender: Any = None, **_: Any) -> None:
    """``worker_init`` (the worker's main process, before the pool starts): serve the
    worker's event counters on ``WORKER_METRICS_PORT``."""
    port = settings.WORKER_METRICS_PORT
    if not port or _serving:
        return
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        multiprocess_dir_reset(directory)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
    elif "prefork" in str(getattr(sender, "pool_cls", "prefork")):
        # Each child would count alone and the main process would serve zeros.
        logger.error(
            "WORKER_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not: the prefork "
            "pool's children cannot share their counts; not serving worker metrics"
        )
        return
    else:
        registry = REGISTRY
    address = settings.WORKER_METRICS_ADDR
    start_http_server(port, addr=address, registry=registry)
    _serving.append(port)
    logger.info("worker metrics served on port %d of %s", port, address, extra={"port": port})


def celery_signals_connect() -> None:
    """Connect the worker-side receivers (idempotent: each has a ``dispatch_uid``)."""
    from celery.signals import task_postrun, task_prerun, worker_init

    task_prerun.connect(_task_started, weak=False, dispatch_uid="core.metrics.started")
    task_postrun.connect(_task_finished, weak=False, dispatch_uid="core.metrics.finished")
    worker_init.connect(_worker_metrics_serve, weak=False, dispatch_uid="core.metrics.serve")
