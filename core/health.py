"""GET /health/: can this deployment take a payment event and turn it into an email, now?

200 with JSON when every critical check passes, 503 naming the failing ones otherwise; never a
500. The checks run in parallel threads within ``HEALTH_TIMEOUT_SECONDS`` in all: one still
running at the deadline counts as failing. Each check also bounds its own calls
(``PROBE_TIMEOUT_SECONDS`` on Redis sockets and on PostgreSQL statements), so a thread left
behind by the deadline ends soon after; each closes the database connection it opened.

The checks (critical ones turn the answer into 503 when failing):

* ``database`` (critical): ``SELECT 1``.
* ``broker`` (critical): Redis ``PING`` on ``CELERY_BROKER_URL``.
* ``outbox`` (critical): unpublished rows (counted up to the hard mark) and the age of the
  oldest; failing when it is older than ``OUTBOX_STALE_SECONDS``: the relay should have
  published it, so emails are not leaving.
* ``backpressure`` (critical): the level of ``core.backpressure``, with the email queue depth;
  ``degraded`` at the soft mark, failing at the hard mark (every webhook is being refused).
* ``dlq`` (not critical): waiting dead letters; ``degraded`` at ``DLQ_ALERT_THRESHOLD``, never
  failing. A dead-letter queue is a human's inbox, not an outage: its alarm is ``dlq_alert``
  (mail and an ERROR log line), and a 503 here would only pull healthy web processes out of a
  load balancer.
* ``breaker`` (not critical, registered by ``invoicing``): the email provider's circuit
  breaker; ``degraded`` while open (emails wait, nothing is lost).
* ``beat`` (not critical, registered by ``core.apps``): the beat process holding the leader
  lock; ``degraded`` when none does.

``register_check(name, fn, critical=...)`` adds a check or replaces the one of that name. A
check returns a dict with at least ``status`` (``ok``, ``degraded``, ``failing`` or
``unknown``) and any figures worth showing; raising counts as ``failing``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, connections, transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_safe

from core import backpressure, queues
from core.deadletters import dlq_depth
from core.models import OutboxMessage

logger = logging.getLogger(__name__)

CheckResult = dict[str, Any]
STATUSES = ("ok", "degraded", "failing", "unknown")


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[], CheckResult]
    critical: bool


_checks: dict[str, Check] = {}


def register_check(name: str, fn: Callable[[], CheckResult], *, critical: bool = True) -> None:
    """Add a check to /health/, or replace the one of that name."""
    _checks[name] = Check(name=name, fn=fn, critical=critical)


def _statement_timeout() -> None:
    """Bound every statement of the current transaction by ``PROBE_TIMEOUT_SECONDS``."""
    ms = max(1, int(settings.PROBE_TIMEOUT_SECONDS * 1000))
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(ms)])


def check_database() -> CheckResult:
    with transaction.atomic(), connection.cursor() as cursor:
        _statement_timeout()
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"status": "ok"}


def check_broker() -> CheckResult:
    client = backpressure.broker_redis()
    if client is None:
        return {"status": "unknown", "detail": "the broker is not Redis"}
    client.ping()
    return {"status": "ok"}


def check_outbox() -> CheckResult:
    cap = settings.BACKPRESSURE_HARD_MARK
    with transaction.atomic():
        _statement_timeout()
        unpublished = backpressure.outbox_backlog(cap=cap)
        oldest = (
            OutboxMessage.objects.filter(published_at__isnull=True)
            .order_by("created_at")
            .values_list("created_at", flat=True)
            .first()
        )
    age = (timezone.now() - oldest).total_seconds() if oldest else None
    stale = age is not None and age > settings.OUTBOX_STALE_SECONDS
    return {
        "status": "failing" if stale else "ok",
        # Counted up to the hard mark only: the count must stay cheap however large it grows.
        "unpublished": unpublished,
        "unpublished_capped": unpublished >= cap,
        "oldest_unpublished_age_seconds": None if age is None else round(age, 1),
        "stale_after_seconds": settings.OUTBOX_STALE_SECONDS,
    }


def check_backpressure() -> CheckResult:
    pressure = backpressure.pressure_measure()
    level = pressure.level()
    status = {"normal": "ok", "soft": "degraded", "hard": "failing"}[level]
    if pressure.email_queue_depth is None and pressure.outbox_backlog is None:
        status = "unknown"
    return {
        "status": status,
        "level": str(level),
        "email_queue_depth": pressure.email_queue_depth,
        "outbox_backlog": pressure.outbox_backlog,
        "soft_mark": settings.BACKPRESSURE_SOFT_MARK,
        "hard_mark": settings.BACKPRESSURE_HARD_MARK,
        "queue": queues.EMAIL,
    }


def check_dlq() -> CheckResult:
    with transaction.atomic():
        _statement_timeout()
        waiting = dlq_depth()
    threshold = settings.DLQ_ALERT_THRESHOLD
    return {
        "status": "degraded" if waiting >= threshold else "ok",
        "waiting": waiting,
        "alert_threshold": threshold,
    }


register_check("database", check_database)
register_check("broker", check_broker)
register_check("outbox", check_outbox)
register_check("backpressure", check_backpressure)
register_check("dlq", check_dlq, critical=False)


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


@require_safe
def health_view(request: HttpRequest) -> JsonResponse:
    try:
        healthy, report = health_report()
        response = JsonResponse(report, status=200 if healthy else 503)
    except Exception as exc:  # a health probe answers 503, never 500
        logger.exception("health report failed")
        response = JsonResponse({"status": "failing", "error": type(exc).__name__}, status=503)
    response["Cache-Control"] = "no-store"
    return response
