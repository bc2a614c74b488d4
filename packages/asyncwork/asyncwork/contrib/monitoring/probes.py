"""The probes: each piece of state watched, declared once as a ``Probe`` (how it is read, and
what ``/health/``, ``/metrics`` and the dashboard make of a reading), and read one way,
``probe_read``. The outbox's backlog and the queues are read as backpressure reads them
(``asyncwork.contrib.backpressure``).

A read function measures now and returns what it read (a frozen dataclass, or rows); it decides
nothing, a probe's parts do. The machinery's probes are declared in
``asyncwork.contrib.monitoring.gauges``, an
app's beside its own state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.db import DatabaseError
from django.db.models import Count, Min
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import Metric

from asyncwork.contrib.backpressure import outbox_backlog, outbox_waiting
from asyncwork.contrib.breaker import Breaker
from asyncwork.contrib.periodic.jobs import jobs_declared
from asyncwork.db import bounded
from asyncwork.deadletters import waiting
from asyncwork.models import ScheduledJob
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)


def _age(since: datetime | None, now: datetime) -> float | None:
    return None if since is None else max(0.0, (now - since).total_seconds())


@dataclass(frozen=True)
class OutboxProbe:
    """Unpublished outbox rows counted up to ``cap`` (the hard mark: cheap however large the
    backlog), and the oldest one's time."""

    unpublished: int
    cap: int
    oldest_unpublished_at: datetime | None
    measured_at: datetime

    @property
    def capped(self) -> bool:
        return self.unpublished >= self.cap

    @property
    def oldest_age_seconds(self) -> float | None:
        return _age(self.oldest_unpublished_at, self.measured_at)

    @property
    def stale(self) -> bool:
        """The oldest row is older than ``OUTBOX_STALE_SECONDS``: jobs are not leaving."""
        age = self.oldest_age_seconds
        return age is not None and age > asyncwork_settings.OUTBOX_STALE_SECONDS


def outbox_probe() -> OutboxProbe:
    cap = asyncwork_settings.BACKPRESSURE_HARD_MARK
    now = timezone.now()
    # A due row has waited since its due time.
    oldest = (
        outbox_waiting(now)
        .annotate(since=Coalesce("due_at", "created_at"))
        .order_by("since")
        .values_list("since", flat=True)
        .first()
    )
    unpublished = outbox_backlog(now=now, cap=cap)
    return OutboxProbe(
        unpublished=unpublished, cap=cap, oldest_unpublished_at=oldest, measured_at=now
    )


@dataclass(frozen=True)
class DlqProbe:
    """Dead letters waiting for an operator (not replayed), by reason, and the oldest."""

    waiting_by_reason: dict[str, int]
    oldest_waiting_at: datetime | None
    measured_at: datetime

    @property
    def waiting(self) -> int:
        return sum(self.waiting_by_reason.values())

    @property
    def oldest_age_seconds(self) -> float | None:
        return _age(self.oldest_waiting_at, self.measured_at)

    @property
    def alerting(self) -> bool:
        """At or past ``DLQ_ALERT_THRESHOLD``, where ``dlq_alert`` mails the admins."""
        return self.waiting >= asyncwork_settings.DLQ_ALERT_THRESHOLD


def dlq_probe() -> DlqProbe:
    """One grouped query over the waiting dead letters."""
    rows = list(
        waiting()
        .order_by("reason")
        .values("reason")
        .annotate(n=Count("pk"), oldest=Min("created_at"))
    )
    return DlqProbe(
        waiting_by_reason={row["reason"]: row["n"] for row in rows},
        oldest_waiting_at=min((row["oldest"] for row in rows), default=None),
        measured_at=timezone.now(),
    )


def scheduled_jobs_probe() -> tuple[ScheduledJob, ...]:
    """What every declared job, and any that ran without being declared, last did, by name; an
    unsaved row (all zeros) for a job without one."""
    rows = {job.name: job for job in ScheduledJob.objects.all()}
    names = sorted({job.name for job in jobs_declared()} | set(rows))
    return tuple(rows.get(name) or ScheduledJob(name=name) for name in names)


@dataclass(frozen=True)
class BreakerProbe:
    """A circuit breaker's ``Breaker.state()``."""

    name: str
    state: str
    failures: int | None
    opened_at: float | None
    retry_in: float
    probing: bool

    @property
    def status(self) -> str:
        """Open or half-open is degraded (its calls wait), not failing; unknown without Redis."""
        states = {"closed": "ok", "open": "degraded", "half-open": "degraded"}
        return states.get(self.state, "unknown")


def breaker_probe(breaker: Breaker) -> BreakerProbe:
    return BreakerProbe(**breaker.state())


@dataclass(frozen=True)
class Figure:
    """A dashboard figure; ``url``: the list behind it; ``status``: ok/degraded/failing/unknown."""

    label: str
    value: str
    url: str = ""
    status: str = "ok"


CheckResult = dict[str, Any]
P = TypeVar("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Probe(Generic[P]):
    """One piece of state: ``read`` (in ``bounded()`` when ``database``) and what each reader makes
    of a reading: /health/'s ``check`` (a dict with ``status`` and its figures; ``critical``: its
    failing fails the deployment; named ``check_name`` when not ``name``), /metrics' families
    (``metrics``), the dashboard's ``figures`` under ``title``."""

    name: str
    read: Callable[[], P]
    database: bool
    check: Callable[[P], CheckResult] | None = None
    critical: bool = True
    check_name: str = ""
    metrics: Callable[[P], list[Metric]] | None = None
    title: str = ""
    figures: Callable[[P], list[Figure]] | None = None


_probes: dict[str, Probe[Any]] = {}


def probe_declare(probe: Probe[Any]) -> None:
    """Declare ``probe``, replacing one of its name in its place."""
    _probes[probe.name] = probe


def probes_declared(part: str) -> list[Probe[Any]]:
    """The probes with ``part`` (``check``, ``metrics`` or ``figures``), in declaration order."""
    return [probe for probe in list(_probes.values()) if getattr(probe, part) is not None]


@dataclass(frozen=True)
class Reading(Generic[T]):
    """What a reader made of one probe now (``shown``), or why it could not (``error``: the class
    only, as a message can carry host names), and what it cost."""

    probe: Probe[Any]
    shown: T | None
    error: str = ""
    ms: float = 0.0
    database_failed: bool = False


def probe_read(probe: Probe[P], part: Callable[[P], T]) -> Reading[T]:
    """Read ``probe`` now (a database one in ``bounded()``, a broker one under its own socket
    timeouts) and make ``part`` of the reading; never raises."""
    started = time.perf_counter()
    try:
        if probe.database:
            with bounded():
                value = probe.read()
        else:
            value = probe.read()
        shown, error, database_failed = part(value), "", False
    except Exception as exc:  # noqa: BLE001 - one failing probe must not hide the rest
        logger.warning("probe %s failed: %r", probe.name, exc)
        shown, error = None, type(exc).__name__
        database_failed = probe.database and isinstance(exc, DatabaseError)
    ms = round((time.perf_counter() - started) * 1000, 2)
    return Reading(probe, shown, error, ms, database_failed)


def probes_read(part: str) -> list[Reading[Any]]:
    """Every probe with ``part``, one after the other; after a database error the remaining
    database probes are skipped (one timeout, not one each)."""
    readings: list[Reading[Any]] = []
    for probe in probes_declared(part):
        if probe.database and any(reading.database_failed for reading in readings):
            readings.append(Reading(probe, None, "skipped: the database failed"))
        else:
            readings.append(probe_read(probe, getattr(probe, part)))
    return readings
