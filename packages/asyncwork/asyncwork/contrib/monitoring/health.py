"""GET /health/: can this deployment take work in and get it done, now? GET /health/live: is this
process serving HTTP?

``/health/`` reads every probe with a ``check`` (``asyncwork.contrib.monitoring.probes``) and
answers 200 when every
critical one passes, 503 otherwise, never 500. Anyone gets ``{"status": ...}`` only, from a report
each process computes at most once per ``HEALTH_CACHE_SECONDS`` (single flight); a staff session
or the ``METRICS_TOKEN`` bearer gets the whole report, computed for the request. The checks run in
parallel within ``HEALTH_TIMEOUT_SECONDS``; one still running then counts as failing, as does one
that raises. ``/health/live`` does no I/O, so a process is never restarted because a dependency
is down.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from asyncwork.contrib.monitoring.metrics import metrics_token_presented
from asyncwork.contrib.monitoring.probes import (
    CheckResult,
    Probe,
    Reading,
    probe_read,
    probes_declared,
)
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)


def _checked(probe: Probe[Any]) -> Reading[CheckResult]:
    """``probe``'s check, on this thread's own connections, closed after."""

    def check(value: Any) -> CheckResult:
        assert probe.check is not None
        result = dict(probe.check(value))
        json.dumps(result, cls=DjangoJSONEncoder)  # one bad figure must not make a 500
        if result.get("status") not in ("ok", "degraded", "failing", "unknown"):
            result["status"] = "unknown"
        return result

    try:
        return probe_read(probe, check)
    finally:
        connections.close_all()


def health_report() -> tuple[bool, dict[str, Any]]:
    probes = probes_declared("check")
    deadline = asyncwork_settings.HEALTH_TIMEOUT_SECONDS
    pool = ThreadPoolExecutor(max_workers=len(probes), thread_name_prefix="health")
    try:
        futures = [pool.submit(_checked, probe) for probe in probes]
        wait(futures, timeout=deadline)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    results: dict[str, CheckResult] = {}
    for probe, future in zip(probes, futures, strict=True):
        name = probe.check_name or probe.name
        if not future.done():
            logger.warning("health check %s timed out after %.1f s", name, deadline)
            error = f"timed out after {deadline:g} s"
            results[name] = {"status": "failing", "error": error, "critical": probe.critical}
            continue
        reading = future.result()
        result = reading.shown or {"status": "failing", "error": reading.error}
        results[name] = {**result, "critical": probe.critical, "ms": round(reading.ms, 1)}
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


def _report() -> tuple[bool, dict[str, Any]]:
    try:
        return health_report()
    except Exception as exc:  # a health probe answers 503, never 500
        logger.exception("health report failed")
        return False, {"status": "failing", "error": type(exc).__name__}


_shared: tuple[float, bool, str] | None = None  # monotonic time, healthy, status
_shared_lock = threading.Lock()


def health_status_shared() -> tuple[bool, str]:
    """Whether the deployment is healthy, and its status, from the report shared as above."""
    global _shared
    with _shared_lock:
        if (
            _shared is None
            or time.monotonic() - _shared[0] >= asyncwork_settings.HEALTH_CACHE_SECONDS
        ):
            healthy, report = _report()
            _shared = (time.monotonic(), healthy, str(report["status"]))
        return _shared[1], _shared[2]


def _may_see_details(request: HttpRequest) -> bool:
    if metrics_token_presented(request):
        return True
    try:
        user = request.user
        return bool(user.is_active and user.is_staff)
    except DatabaseError:
        # A session cookie with the database down: answer as to anyone, not with a 500.
        return False


def _no_store(body: dict[str, Any], healthy: bool = True) -> JsonResponse:
    response = JsonResponse(body, status=200 if healthy else 503)
    response["Cache-Control"] = "no-store"
    return response


@require_safe
def health_view(request: HttpRequest) -> JsonResponse:
    if not _may_see_details(request):
        healthy, status = health_status_shared()
        return _no_store({"status": status}, healthy)
    healthy, report = _report()
    return _no_store(report, healthy)


@require_safe
def live_view(request: HttpRequest) -> JsonResponse:
    return _no_store({"status": "ok"})
