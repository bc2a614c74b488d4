"""GET /health/: can this deployment take work in and get it done, now? GET /health/live: is this
process serving HTTP?

``/health/`` answers 200 when every critical check passes, 503 otherwise, never 500. Anyone gets
``{"status": ...}`` only, from a report each process computes at most once per
``HEALTH_CACHE_SECONDS`` (single flight); a staff session or the ``METRICS_TOKEN`` bearer gets
the whole report, computed for the request. The checks run in parallel within
``HEALTH_TIMEOUT_SECONDS``; one still running then counts as failing. ``dlq`` and ``beat`` are
not critical: dead letters are a human's inbox (``dlq_alert``), and a 503 would only pull healthy
web processes out of a load balancer.

An app adds checks with ``@health_check(name, critical=...)``: a check returns a dict with
``status`` (``ok``, ``degraded``, ``failing``, ``unknown``) and its figures; raising counts as
failing. ``/health/live`` does no I/O, so a process is never restarted because a dependency is
down.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connection, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from asyncwork import backpressure, queues, rabbitmq
from asyncwork.broker import broker_redis
from asyncwork.db import bounded
from asyncwork.metrics import metrics_token_presented
from asyncwork.probes import beat_probe, dlq_probe, outbox_probe

logger = logging.getLogger(__name__)

CheckResult = dict[str, Any]
STATUSES = ("ok", "degraded", "failing", "unknown")


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[], CheckResult]
    critical: bool


_checks: dict[str, Check] = {}
C = TypeVar("C", bound=Callable[[], CheckResult])


def health_check(name: str, *, critical: bool = True) -> Callable[[C], C]:
    """Add the decorated function to /health/ as check ``name`` (replacing one of that name)."""

    def declare(fn: C) -> C:
        _checks[name] = Check(name=name, fn=fn, critical=critical)
        return fn

    return declare


@health_check("database")
def check_database() -> CheckResult:
    with bounded(), connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"status": "ok"}


@health_check("broker")
def check_broker() -> CheckResult:
    if settings.BROKER_IS_RABBITMQ:
        rabbitmq.broker_ping()  # raises when RabbitMQ does not answer in time
        return {"status": "ok"}
    client = broker_redis()
    if client is None:
        return {"status": "unknown", "detail": "the broker is neither Redis nor RabbitMQ"}
    client.ping()
    return {"status": "ok"}


@health_check("outbox")
def check_outbox() -> CheckResult:
    with bounded():
        outbox = outbox_probe()
    age = outbox.oldest_age_seconds
    return {
        "status": "failing" if outbox.stale else "ok",
        # Counted up to the hard mark: the count stays cheap however large the backlog.
        "unpublished": outbox.unpublished,
        "unpublished_capped": outbox.capped,
        "oldest_unpublished_age_seconds": None if age is None else round(age, 1),
        "stale_after_seconds": settings.OUTBOX_STALE_SECONDS,
    }


@health_check("backpressure")
def check_backpressure() -> CheckResult:
    pressure = backpressure.pressure_measure()
    level = pressure.level()
    status = {"normal": "ok", "soft": "degraded", "hard": "failing"}[level]
    if pressure.queue_depth is None and pressure.outbox_backlog is None:
        status = "unknown"
    return {
        "status": status,
        "level": str(level),
        "queue_depth": pressure.queue_depth,
        "outbox_backlog": pressure.outbox_backlog,
        "soft_mark": settings.BACKPRESSURE_SOFT_MARK,
        "hard_mark": settings.BACKPRESSURE_HARD_MARK,
        "queues": list(queues.pressure_queues()),
    }


@health_check("dlq", critical=False)
def check_dlq() -> CheckResult:
    with bounded():
        dlq = dlq_probe()
    return {
        "status": "degraded" if dlq.alerting else "ok",
        "waiting": dlq.waiting,
        "alert_threshold": settings.DLQ_ALERT_THRESHOLD,
    }


@health_check("beat", critical=False)
def check_beat() -> CheckResult:
    """Degraded, not failing: without beat the jobs still run; only the safety nets wait."""
    beat = beat_probe()
    active = asdict(beat.active) if beat.active else None  # {"host": ..., "pid": ...}
    return {"status": "ok" if beat.active else "degraded", "active": active}


def _run(check: Check) -> CheckResult:
    started = time.perf_counter()
    try:
        result = dict(check.fn())
        json.dumps(result, cls=DjangoJSONEncoder)  # one bad figure must not make a 500
        if result.get("status") not in STATUSES:
            result["status"] = "unknown"
    except Exception as exc:  # noqa: BLE001 - any failure of a check is that check failing
        logger.warning("health check %s failed: %r", check.name, exc)
        # The class only: a message can carry host names and ports.
        result = {"status": "failing", "error": type(exc).__name__}
    finally:
        connections.close_all()  # this thread's connections only
    result["critical"] = check.critical
    result["ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


def health_report() -> tuple[bool, dict[str, Any]]:
    """Run every registered check in parallel, within ``HEALTH_TIMEOUT_SECONDS`` in all."""
    checks = list(_checks.values())
    deadline = settings.HEALTH_TIMEOUT_SECONDS
    pool = ThreadPoolExecutor(max_workers=len(checks), thread_name_prefix="health")
    try:
        futures = {check.name: pool.submit(_run, check) for check in checks}
        wait(futures.values(), timeout=deadline)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    results: dict[str, CheckResult] = {}
    for check in checks:
        future = futures[check.name]
        if future.done():
            results[check.name] = future.result()
        else:
            logger.warning("health check %s timed out after %.1f s", check.name, deadline)
            results[check.name] = {
                "status": "failing",
                "error": f"timed out after {deadline:g} s",
                "critical": check.critical,
            }
    failing = [n for n, r in results.items() if r["critical"] and r["status"] == "failing"]
    degraded = [
        n for n, r in results.items() if n not in failing and r["status"] in ("degraded", "failing")
    ]
    status = "failing" if failing else "degraded" if degraded else "ok"
    return not failing, {
        "status": status,
        "failing": failing,
        "degraded": degraded,
        "checks": results,
    }


@dataclass(frozen=True)
class _Shared:
    at: float  # monotonic time the report was finished
    healthy: bool
    status: str


_shared: _Shared | None = None
_shared_lock = threading.Lock()


def _fresh(shared: _Shared | None) -> bool:
    return shared is not None and time.monotonic() - shared.at < settings.HEALTH_CACHE_SECONDS


def health_status_shared() -> tuple[bool, str]:
    """Whether the deployment is healthy, and its status, from a report at most
    ``HEALTH_CACHE_SECONDS`` old; one caller computes it while the others wait for its result."""
    global _shared
    shared = _shared
    if not _fresh(shared):
        with _shared_lock:
            shared = _shared
            if not _fresh(shared):
                try:
                    healthy, report = health_report()
                    status = str(report["status"])
                except Exception:  # a health probe answers 503, never 500
                    logger.exception("health report failed")
                    healthy, status = False, "failing"
                shared = _Shared(at=time.monotonic(), healthy=healthy, status=status)
                _shared = shared
    assert shared is not None
    return shared.healthy, shared.status


def _may_see_details(request: HttpRequest) -> bool:
    if metrics_token_presented(request):
        return True
    try:
        user = request.user
        return bool(user.is_active and user.is_staff)
    except DatabaseError:
        # A session cookie with the database down: answer as to anyone, not with a 500.
        return False


def _no_store(response: JsonResponse) -> JsonResponse:
    response["Cache-Control"] = "no-store"
    return response


@require_safe
def health_view(request: HttpRequest) -> JsonResponse:
    if not _may_see_details(request):
        healthy, status = health_status_shared()
        return _no_store(JsonResponse({"status": status}, status=200 if healthy else 503))
    try:
        healthy, report = health_report()
        response = JsonResponse(report, status=200 if healthy else 503)
    except Exception as exc:  # a health probe answers 503, never 500
        logger.exception("health report failed")
        response = JsonResponse({"status": "failing", "error": type(exc).__name__}, status=503)
    return _no_store(response)


@require_safe
def live_view(request: HttpRequest) -> JsonResponse:
    """200 while this process serves HTTP; reads nothing."""
    return _no_store(JsonResponse({"status": "ok"}))
