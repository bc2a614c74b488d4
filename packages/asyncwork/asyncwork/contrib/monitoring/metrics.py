"""Prometheus metrics: state computed at scrape time, and events counted where they happen.

State (``StateCollector``, ``GET /metrics`` of the web process) is read from PostgreSQL and the
brokers when Prometheus asks: exact, whichever process did the work. Its sources are the probes
with ``metrics`` (``asyncwork.contrib.monitoring.probes``); one that fails is left out and reported
as
``<prefix>metrics_source_up{source} 0``, after a database error the other database sources are
skipped, and ``/metrics`` never answers 500.

Events are counters per process group. With ``PROMETHEUS_MULTIPROC_DIR`` set, gunicorn's
processes are summed through its files. With ``WORKER_METRICS_PORT`` set a worker's main process
serves its counts; under prefork that requires a directory of its own, emptied at start, summing
every child, dead ones included.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from celery.signals import worker_init
from django.http import HttpRequest, HttpResponse
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
from prometheus_client.core import GaugeMetricFamily, Metric

from asyncwork.backend import job_publish_failed, job_published, job_ran, rescued, task_started
from asyncwork.contrib.http import (
    address_parse,
    address_within,
    client_address,
    networks,
    peer_is_trusted_proxy,
)
from asyncwork.settings import asyncwork_settings

# Public here: an application's own metrics take the same prefix.
from asyncwork.settings import metric_name as metric_name

logger = logging.getLogger(__name__)

# Every metric here is labelled: none writes a value (or a multiprocess file) until first used.
# Each is made on first use, as its name reads the settings (a module never does as it loads).


@cache
def task_starts() -> Counter:
    return Counter(
        metric_name("task_starts"), "Job runs started by this worker, by task.", ["task"]
    )


@cache
def task_attempts() -> Counter:
    return Counter(
        metric_name("task_attempts"),
        "Job runs finished by this worker, by task and outcome: successful, retry (a transient "
        "failure, retried), deferred (dependency down; no attempt spent), failed "
        "(dead-lettered).",
        ["task", "outcome"],
    )


@cache
def outbox_publish_latency() -> Histogram:
    return Histogram(
        metric_name("outbox_publish_latency_seconds"),
        "Seconds from a job's row's creation to its first publish to the broker.",
        ["queue"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
    )


@cache
def outbox_publish_failures() -> Counter:
    return Counter(
        metric_name("outbox_publish_failures"),
        "Job publishes that failed (broker down or stalled); the relay retries the row.",
        ["queue"],
    )


@cache
def worker_rescues() -> Counter:
    return Counter(
        metric_name("worker_rescues"),
        "Jobs and claims of worker processes that are gone, released and re-enqueued by a "
        "rescue, by rescue: jobs, or the name an app declared.",
        ["rescue"],
    )


@cache
def suspicious_requests() -> Counter:
    return Counter(
        metric_name("http_suspicious_requests"),
        "Requests Django answered 400 as suspicious, by kind (the SuspiciousOperation's "
        "class, e.g. DisallowedHost, a Host header not in ALLOWED_HOSTS).",
        ["kind"],
    )


class StateCollector:
    def collect(self) -> Iterable[Metric]:
        # Imported here: this module loads with Celery's app (asyncwork.logging), before Django's
        # apps, and the probes import the models.
        from asyncwork.contrib.monitoring.probes import probes_read

        started = time.perf_counter()
        up = GaugeMetricFamily(
            metric_name("metrics_source_up"),
            "1 when the source answered in this scrape, 0 when it failed or was skipped.",
            labels=["source"],
        )
        for reading in probes_read("metrics"):
            up.add_metric([reading.probe.name], 0.0 if reading.error else 1.0)
            yield from reading.shown or ()
        yield up
        yield GaugeMetricFamily(
            metric_name("metrics_scrape_duration_seconds"),
            "Seconds the scrape-time sources took.",
            value=time.perf_counter() - started,
        )


_state_registry = CollectorRegistry(auto_describe=False)
_state_registry.register(StateCollector())


def _event_registry() -> CollectorRegistry:
    """The event counters, summed over ``PROMETHEUS_MULTIPROC_DIR`` when set."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def metrics_token_presented(request: HttpRequest) -> bool:
    """True when ``METRICS_TOKEN`` is set and the request carries it as a bearer token (compared in
    constant time). It opens ``/metrics`` and ``/health/``'s details."""
    token = asyncwork_settings.METRICS_TOKEN
    if not token:
        return False
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and constant_time_compare(given.strip(), token)


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """None when the request may read /metrics: it has ``METRICS_TOKEN`` when set, else comes from
    ``METRICS_ALLOWED_NETWORKS`` (with no ``X-Forwarded-For`` unless via ``TRUSTED_PROXIES``)."""
    if asyncwork_settings.METRICS_TOKEN:
        if metrics_token_presented(request):
            return None
        response = HttpResponse("bearer token required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    forbidden = HttpResponse("forbidden\n", status=403, content_type="text/plain")
    if "HTTP_X_FORWARDED_FOR" in request.META and not peer_is_trusted_proxy(request):
        return forbidden
    address = address_parse(client_address(request))
    allowed = networks(tuple(asyncwork_settings.METRICS_ALLOWED_NETWORKS))
    if address is not None and address_within(address, allowed):
        return None
    return forbidden


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    try:
        # Event counters, then scrape-time state.
        body = generate_latest(_event_registry()) + generate_latest(_state_registry)
        response = HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
    except Exception:  # a scrape that cannot be served is a 503, never a 500
        logger.exception("metrics exposition failed")
        response = HttpResponse("metrics unavailable\n", status=503, content_type="text/plain")
    response["Cache-Control"] = "no-store"
    return response


def _task_started(task_result: Any = None, **_: Any) -> None:
    """django.tasks' ``task_started``, which the runner sends for each job's run."""
    task_starts().labels(task=task_result.task.module_path).inc()


def _job_ran(task: str = "", outcome: str = "", **_: Any) -> None:
    task_attempts().labels(task=task, outcome=outcome).inc()


def multiprocess_dir_reset() -> None:
    """Empty ``PROMETHEUS_MULTIPROC_DIR`` (creating it), so an earlier run's counts are not added.
    Call once, in the parent, before workers fork."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)


_serving: list[int] = []


def _worker_metrics_serve(sender: Any = None, **_: Any) -> None:
    """``worker_init``: serve the event counters on ``WORKER_METRICS_PORT``."""
    port = asyncwork_settings.WORKER_METRICS_PORT
    if not port or _serving:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess_dir_reset()
    elif "prefork" in str(getattr(sender, "pool_cls", "prefork")):
        # Each child would count alone and the main process would serve zeros.
        logger.error(
            "WORKER_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not: the prefork "
            "pool's children cannot share their counts; not serving worker metrics"
        )
        return
    address = asyncwork_settings.WORKER_METRICS_ADDR
    start_http_server(port, addr=address, registry=_event_registry())
    _serving.append(port)
    logger.info("worker metrics served on port %d of %s", port, address, extra={"port": port})


def _published(queue: str = "", seconds: float = 0.0, **_: Any) -> None:
    outbox_publish_latency().labels(queue=queue).observe(seconds)


def _publish_failed(queue: str = "", **_: Any) -> None:
    outbox_publish_failures().labels(queue=queue).inc()


def _rescued(rescue: str = "", count: int = 0, **_: Any) -> None:
    worker_rescues().labels(rescue=rescue).inc(count)


def receivers_connect() -> None:
    """Count what the machinery tells (``asyncwork.backend``'s signals), and serve a worker's
    counts; idempotent (``dispatch_uid``)."""
    job_published.connect(_published, weak=False, dispatch_uid="asyncwork.metrics.published")
    job_publish_failed.connect(
        _publish_failed, weak=False, dispatch_uid="asyncwork.metrics.publish_failed"
    )
    rescued.connect(_rescued, weak=False, dispatch_uid="asyncwork.metrics.rescued")
    task_started.connect(_task_started, weak=False, dispatch_uid="asyncwork.metrics.started")
    job_ran.connect(_job_ran, weak=False, dispatch_uid="asyncwork.metrics.ran")
    worker_init.connect(_worker_metrics_serve, weak=False, dispatch_uid="asyncwork.metrics.serve")
