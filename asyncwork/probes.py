"""One probe per subsystem: the figures ``/health/``, ``/metrics``, backpressure and the admin
dashboard read.

A probe measures one subsystem now and returns a small frozen dataclass of figures; it decides
nothing. Its readers decide: ``asyncwork.health`` turns it into a check's status,
``asyncwork.gauges`` into Prometheus families, ``asyncwork.backpressure`` into a level to shed
at, ``asyncwork.dashboard`` into figures with links to the lists behind them. So they all
measure each figure the same way (the outbox backlog is counted up to the hard mark everywhere)
and cannot drift apart.

A probe that reads PostgreSQL opens no transaction of its own: its caller runs it inside
``bounded()``, a transaction whose statements give up after ``PROBE_TIMEOUT_SECONDS``, as
``/health/`` runs each check and ``/metrics`` each database source. A probe of Redis or
RabbitMQ bounds its own calls (the broker client's socket timeouts, the breaker's).

The machinery's probes are here: outbox, dead letters, scheduled jobs, beat, broker queues, and
any circuit breaker. The dashboard shows a probe through a function that turns its reading into
figures, declared with ``@dashboard_probe(name, probe, ...)`` (the machinery's in
``asyncwork.dashboard``, an app's beside its own probes: invoicing's emails and its provider's
breaker); a health check or metrics source calls the same probe function.
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


# --- The machinery's probes -------------------------------------------------------------------


@dataclass(frozen=True)
class OutboxProbe:
    """Unpublished outbox rows, counted up to ``cap`` (the hard mark: the count must stay cheap
    however large the backlog grows), and the oldest one's creation time."""

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
        """The oldest row is older than ``OUTBOX_STALE_SECONDS``: the relay should have
        published it, so jobs are not leaving."""
        age = self.oldest_age_seconds
        return age is not None and age > settings.OUTBOX_STALE_SECONDS


def outbox_backlog(*, now: datetime, cap: int) -> int:
    """The outbox rows waiting to be published at ``now``, counted up to ``cap``: rows
    scheduled for later (a retry inside its backoff) are no backlog until due. A count over a
    LIMIT: the scan of the partial index stops at the cap. ``outbox_probe``'s first figure, and
    all that backpressure reads (each second, in every web process), without the search for
    the oldest row, which reads every waiting row however many there are."""
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
    """Every declared job, and any job that has run without being declared (any more), by
    name."""

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
    """Messages waiting on each broker queue (not those a worker holds): the queues workers
    consume and, on RabbitMQ, ``dlq``, which nobody does (``queues.watched``). On RabbitMQ,
    each queue's consumers too (None on Redis, which does not know them)."""

    depths: dict[str, int]
    consumers: dict[str, int] | None = None


class BrokerUnreadable(ConnectionError):
    """The broker did not answer a read of its queues in time."""


def queues_probe(names: tuple[str, ...] | None = None) -> QueuesProbe:
    """On Redis, one pipelined round trip for every queue's priority lists; on RabbitMQ, one
    passive declaration per queue on a kept connection (``asyncwork.rabbitmq``). Raises
    ``BrokerUnreadable`` (an ``OSError``) when the broker does not answer in time."""
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
    """A circuit breaker's state (``closed``, ``open``, ``half-open``, or ``unknown`` when
    Redis does not answer), its consecutive failures, when it opened (Unix time), the seconds
    left of its cool-down, and whether a probe is out."""

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


# --- The dashboard's registry -------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One figure of the dashboard: what it is, its value as shown, the list behind it, and
    whether it calls for attention (``ok``, ``degraded``, ``failing``, ``unknown``)."""

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
    """Show the probe ``fn`` on the dashboard under ``title`` (or replace the one of that
    name), as the figures the decorated function makes of its result. A ``database`` probe
    runs in ``bounded()``. Shown in the order declared."""

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
    """Every registered probe, read one after the other, each bounded. One that fails shows
    its error's class (a message can carry host names); after a database error the remaining
    database probes are skipped, so a dead database costs one connect timeout, not one each."""
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
