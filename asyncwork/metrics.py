"""Prometheus metrics: what each process exposes, and why there.

Two kinds of figures, kept apart because they live in different places:

**State, computed at scrape time** (``StateCollector``, served only by the web process at
``GET /metrics``). Read from PostgreSQL and Redis when Prometheus asks, so they are exact
whichever process (or host) did the work, and survive every restart. The machinery's sources
(``asyncwork.gauges``): the outbox backlog and the age of its oldest unpublished row, the
dead-letter depth, the depth of the pressure queues on the broker, each scheduled job's runs,
skips and last run; an app adds its own with ``@metrics_source(name, database=...)`` on the
function that reads them. Each source runs in its own transaction under a statement timeout
of ``PROBE_TIMEOUT_SECONDS``; a source that fails or times out is left out of that scrape and
reported as ``invoicing_metrics_source_up{source} 0`` (after a database error the remaining
database sources are skipped, so a dead database costs one connect timeout, not one each).
``/metrics`` never answers 500. Each state source reads its subsystem's probe
(``asyncwork.probes``), the functions ``/health/`` and the admin dashboard read too.

**Events, counted where they happen** (prometheus-client counters and a histogram):

* web process: what the apps count as they answer (webhook deliveries by outcome), requests
  Django refused as suspicious (a Host header not in ``ALLOWED_HOSTS``: a scan shows here, in
  one WARNING line per request, ``asyncwork.logging.SuspiciousRequestFilter``), and outbox
  publishes (latency from the row's creation to its publish, and failures). gunicorn runs
  several worker processes: with ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus-client keeps
  every process's values in memory-mapped files there and ``/metrics`` sums them
  (``MultiProcessCollector``); without it (``runserver``, tests) the default registry of the
  one process is served.
* Celery workers (other processes, possibly other hosts): task starts, attempts by outcome
  (success, retry, deferred, failure, rejected), what an app's tasks count themselves
  (invoicing: the emails sent), and the outbox publishes they make (the relay job,
  dead-letter copies), counted by Celery signal receivers. With
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

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from celery.signals import task_postrun, task_prerun, worker_init
from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    generate_latest,
    multiprocess,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from asyncwork.db import bounded
from asyncwork.errors import Deferred
from operators.http import (
    address_parse,
    address_within,
    client_address,
    networks,
    peer_is_trusted_proxy,
)

logger = logging.getLogger(__name__)

# --- Event counters ---------------------------------------------------------------------------
# Every metric here has labels: a labelled metric creates no value (and, in multiprocess
# mode, no file) until it is first used, so importing this module writes nothing.

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

SUSPICIOUS_REQUESTS = Counter(
    "invoicing_http_suspicious_requests",
    "Requests Django answered 400 as suspicious, by kind (the SuspiciousOperation): "
    "DisallowedHost, a Host header not in ALLOWED_HOSTS.",
    ["kind"],
)


def suspicious_request_count(kind: str) -> None:
    """One request refused as suspicious; ``kind`` names the ``SuspiciousOperation`` (a class
    name, never the client's text: the label's values stay few)."""
    SUSPICIOUS_REQUESTS.labels(kind=kind).inc()


# --- Scrape-time state ------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    fn: Callable[[], Iterable[Metric]]
    database: bool


_sources: dict[str, Source] = {}
S = TypeVar("S", bound=Callable[[], Iterable[Metric]])


def metrics_source(name: str, *, database: bool) -> Callable[[S], S]:
    """Add the decorated function to ``/metrics`` as the scrape-time source ``name`` (or
    replace the one of that name). A ``database`` source runs in a transaction bounded by
    ``PROBE_TIMEOUT_SECONDS``."""

    def declare(fn: S) -> S:
        _sources[name] = Source(name=name, fn=fn, database=database)
        return fn

    return declare


class StateCollector:
    """Runs every registered source at scrape time; see the module docstring."""

    def collect(self) -> Iterable[Metric]:
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
    token; otherwise a client inside ``METRICS_ALLOWED_NETWORKS`` (loopback by default),
    judged on the application's client address (``operators.http.client_address``). A request
    carrying ``X-Forwarded-For`` from a peer that is not one of ``TRUSTED_PROXIES`` came
    through a proxy the app was not told about, whose own (internal) address says nothing
    about the client: refused."""
    if settings.METRICS_TOKEN:
        if metrics_token_presented(request):
            return None
        response = HttpResponse("bearer token required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    forbidden = HttpResponse("forbidden\n", status=403, content_type="text/plain")
    if "HTTP_X_FORWARDED_FOR" in request.META and not peer_is_trusted_proxy(request):
        return forbidden
    address = address_parse(client_address(request))
    allowed = networks(tuple(settings.METRICS_ALLOWED_NETWORKS))
    if address is not None and address_within(address, allowed):
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
    outcome = _OUTCOMES.get(state or "", "unknown")
    if outcome == "retry" and isinstance(getattr(retval, "exc", None), Deferred):
        outcome = "deferred"
    TASK_ATTEMPTS.labels(task=_task_name(task), outcome=outcome).inc()


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
    task_prerun.connect(_task_started, weak=False, dispatch_uid="asyncwork.metrics.started")
    task_postrun.connect(_task_finished, weak=False, dispatch_uid="asyncwork.metrics.finished")
    worker_init.connect(_worker_metrics_serve, weak=False, dispatch_uid="asyncwork.metrics.serve")
