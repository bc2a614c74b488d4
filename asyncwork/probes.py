"""One probe per subsystem: the figures ``/health/``, ``/metrics``, backpressure and the dashboard
read.

A probe measures now and returns a frozen dataclass; it decides nothing. Its readers
(``asyncwork.health``, ``.gauges``, ``.backpressure``, ``.dashboard``) decide, so all measure
each figure the same way. A PostgreSQL probe opens no transaction: its caller runs it in
``bounded()``. A Redis or RabbitMQ probe bounds its own calls.

The dashboard shows a probe through a function declared with ``@dashboard_probe`` that turns its
reading into ``Figure``s (the machinery's in ``asyncwork.dashboard``, an app's beside its own
probes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

import redis
from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, Min
from django.db.models.functions import Coalesce
from django.utils import timezone

from asyncwork import queues, rabbitmq
from asyncwork.beat import active_beat
from asyncwork.breaker import Breaker
from asyncwork.broker import broker_redis, queue_keys
from asyncwork.db import bounded
from asyncwork.deadletters import dead_letters_waiting
from asyncwork.jobs import jobs_declared
from asyncwork.locks import Holder
from asyncwork.models import OutboxMessage, ScheduledJob

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
        return age is not None and age > settings.OUTBOX_STALE_SECONDS


def outbox_backlog(*, now: datetime, cap: int) -> int:
    """Outbox rows waiting at ``now`` (a row scheduled for later is no backlog until due), counted
    up to ``cap``: the index scan stops there. All that backpressure reads, each second in every
    web process."""
    return OutboxMessage.objects.waiting(now)[:cap].count()


def outbox_probe() -> OutboxProbe:
    cap = settings.BACKPRESSURE_HARD_MARK
    now = timezone.now()
    unpublished = outbox_backlog(now=now, cap=cap)
    # A due row has waited since its due time.
    waiting = OutboxMessage.objects.waiting(now)
    oldest = (
        waiting.annotate(since=Coalesce("due_at", "created_at"))
        .order_by("since")
        .values_list("since", flat=True)
        .first()
    )
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
        return self.waiting >= settings.DLQ_ALERT_THRESHOLD


def dlq_probe() -> DlqProbe:
    """One grouped query over the waiting dead letters."""
    rows = (
        dead_letters_waiting()
        .order_by()
        .values("reason")
        .annotate(n=Count("pk"), oldest=Min("created_at"))
    )
    by_reason: dict[str, int] = {}
    oldest: datetime | None = None
    for row in rows:
        by_reason[row["reason"]] = row["n"]
        oldest = row["oldest"] if oldest is None else min(oldest, row["oldest"])
    return DlqProbe(
        waiting_by_reason=dict(sorted(by_reason.items())),
        oldest_waiting_at=oldest,
        measured_at=timezone.now(),
    )


@dataclass(frozen=True)
class JobState:
    """What one scheduled job last did (``ScheduledJob``; all zeros before its first run)."""

    name: str
    pk: int | None
    runs: int = 0
    skips: int = 0
    last_started_at: datetime | None = None
    last_finished_at: datetime | None = None
    last_skipped_at: datetime | None = None
    last_error: str = ""


@dataclass(frozen=True)
class ScheduledJobsProbe:
    """Every declared job, and any that ran without being declared, by name."""

    jobs: tuple[JobState, ...]


def scheduled_jobs_probe() -> ScheduledJobsProbe:
    rows = {
        row["name"]: JobState(**row)
        for row in ScheduledJob.objects.values(
            "name",
            "pk",
            "runs",
            "skips",
            "last_started_at",
            "last_finished_at",
            "last_skipped_at",
            "last_error",
        )
    }
    names = sorted({job.name for job in jobs_declared()} | set(rows))
    return ScheduledJobsProbe(
        jobs=tuple(rows.get(name) or JobState(name=name, pk=None) for name in names)
    )


@dataclass(frozen=True)
class BeatProbe:
    """The beat process holding the leader lock (its host and pid), or None."""

    active: Holder | None


def beat_probe() -> BeatProbe:
    return BeatProbe(active=active_beat())


@dataclass(frozen=True)
class QueuesProbe:
    """Messages waiting on each watched queue (``queues.watched``), not those a worker holds; on
    RabbitMQ each queue's consumers too."""

    depths: dict[str, int]
    consumers: dict[str, int] | None = None


class BrokerUnreadable(ConnectionError):
    """The broker did not answer a read of its queues in time."""


def queues_probe(names: tuple[str, ...] | None = None) -> QueuesProbe:
    """One pipelined round trip on Redis; one passive declaration per queue on RabbitMQ
    (``asyncwork.rabbitmq``). Raises ``BrokerUnreadable`` (an ``OSError``) when the broker does
    not answer in time."""
    names = names or queues.watched()
    if settings.BROKER_IS_RABBITMQ:
        try:
            read = rabbitmq.queue_depths(names)
        except rabbitmq.BrokerUnreadable as exc:
            raise BrokerUnreadable(str(exc)) from exc
        return QueuesProbe(
            depths={name: ready for name, (ready, _) in read.items()},
            consumers={name: consumers for name, (_, consumers) in read.items()},
        )
    client = broker_redis()
    if client is None:
        raise ValueError("the broker is neither Redis nor RabbitMQ")
    keys = {name: queue_keys(name) for name in names}
    try:
        with client.pipeline(transaction=False) as pipe:
            for name in names:
                for key in keys[name]:
                    pipe.llen(key)
            lengths = iter(pipe.execute())
    except redis.RedisError as exc:
        raise BrokerUnreadable(type(exc).__name__) from exc
    return QueuesProbe(depths={name: sum(int(next(lengths)) for _ in keys[name]) for name in names})


def queue_depth(name: str) -> int:
    """One queue's depth (``queues_probe`` of that queue alone)."""
    return queues_probe((name,)).depths[name]


@dataclass(frozen=True)
class BreakerProbe:
    """A circuit breaker's ``Breaker.state()``."""

    name: str
    state: str
    failures: int | None
    opened_at: float | None
    retry_in: float
    probing: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def breaker_probe(breaker: Breaker) -> BreakerProbe:
    return BreakerProbe(**breaker.state())


@dataclass(frozen=True)
class Figure:
    """One dashboard figure: label, value as shown, the list behind it, and its status (``ok``,
    ``degraded``, ``failing``, ``unknown``)."""

    label: str
    value: str
    url: str = ""
    status: str = "ok"


P = TypeVar("P")


@dataclass(frozen=True)
class Probe(Generic[P]):
    name: str
    title: str
    fn: Callable[[], P]
    figures: Callable[[P], list[Figure]]
    database: bool


_probes: dict[str, Probe[Any]] = {}


def dashboard_probe(
    name: str, fn: Callable[[], P], *, title: str, database: bool
) -> Callable[[Callable[[P], list[Figure]]], Callable[[P], list[Figure]]]:
    """Show probe ``fn`` on the dashboard under ``title`` (replacing one of that name), as the
    figures the decorated function makes of its result; in declaration order. A ``database``
    probe runs in ``bounded()``."""

    def declare(figures: Callable[[P], list[Figure]]) -> Callable[[P], list[Figure]]:
        _probes[name] = Probe(name=name, title=title, fn=fn, figures=figures, database=database)
        return figures

    return declare


@dataclass(frozen=True)
class Reading:
    """One probe's figures as read now, or why it could not be read, and what it cost."""

    name: str
    title: str
    figures: list[Figure]
    error: str
    ms: float


def probes_read() -> list[Reading]:
    """Every registered probe, one after the other, each bounded. A failure shows its error's class
    (a message can carry host names); after a database error the remaining database probes are
    skipped."""
    readings: list[Reading] = []
    database_failed = False
    for probe in list(_probes.values()):
        started = time.perf_counter()
        figures: list[Figure] = []
        error = ""
        if probe.database and database_failed:
            error = "skipped: the database failed"
        else:
            try:
                if probe.database:
                    with bounded():
                        result = probe.fn()
                else:
                    result = probe.fn()
                figures = probe.figures(result)
            except Exception as exc:  # noqa: BLE001 - one failing probe must not hide the rest
                database_failed = database_failed or (
                    probe.database and isinstance(exc, DatabaseError)
                )
                logger.warning("probe %s failed: %r", probe.name, exc)
                error = type(exc).__name__
        readings.append(
            Reading(
                name=probe.name,
                title=probe.title,
                figures=figures,
                error=error,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )
        )
    return readings
