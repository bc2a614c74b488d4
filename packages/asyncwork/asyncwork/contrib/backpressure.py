"""Backpressure: when accepted work is not draining, accept less, in a fixed order.

The backlog is the larger of the unpublished outbox rows and the messages waiting on the pressure
queues (``asyncwork.broker.pressure``). Below ``BACKPRESSURE_SOFT_MARK`` nothing is shed; at the
soft mark, what the caller says is not essential is refused with 503 + Retry-After and not
stored; at ``BACKPRESSURE_HARD_MARK``, everything. A 200 is only sent for work committed to
PostgreSQL, so what is shed is delivered again later by its sender: nothing acknowledged is
dropped.

Each process reads the figures at most once per ``BACKPRESSURE_CHECK_SECONDS``; the outbox count
is capped at the hard mark, so its cost stops growing. A figure that cannot be measured
(PostgreSQL or the broker down) sheds nothing: an outage is answered where it bites.

The backlog is read here, one way, and ``/health/``, ``/metrics`` and the dashboard show the same
readings (``asyncwork.contrib.monitoring`` imports them): the outbox rows waiting
(``outbox_waiting``, ``outbox_backlog``) and the messages waiting on queues (``queues_probe``: a
Redis list's length, one pipelined round trip; RabbitMQ's ready messages and consumers, by
passive declaration, on one connection per process kept between reads).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from celery import current_app
from django.db import DatabaseError
from django.db.models import Q, QuerySet
from django.utils import timezone
from kombu import Connection

from asyncwork import broker
from asyncwork.models import Job
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)


def outbox_waiting(now: datetime) -> QuerySet[Job]:
    """Jobs due for publishing by ``now``: unpublished and not scheduled for later (a row
    scheduled for later is no backlog until due)."""
    return Job.objects.filter(published_at__isnull=True, status=Job.Status.READY).filter(
        Q(due_at__isnull=True) | Q(due_at__lte=now)
    )


def outbox_backlog(*, now: datetime, cap: int) -> int:
    """Outbox rows waiting at ``now``, counted up to ``cap``, where the index scan stops:
    backpressure reads it each second per process."""
    return outbox_waiting(now)[:cap].count()


class BrokerUnreadable(ConnectionError):
    """The broker did not answer a read of its queues in time (or refused the connection)."""


class _Reader:
    """One AMQP connection per process, kept and reopened after any error, with socket timeouts of
    ``PROBE_TIMEOUT_SECONDS``. One read at a time (AMQP connections are not for sharing threads);
    a caller that cannot have it within the timeout gets ``BrokerUnreadable``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connection: Connection | None = None
        self.channel: Any = None
        self.key: tuple[str, float, int] | None = None

    def _channel(self, url: str, timeout: float) -> Any:
        key = (url, timeout, os.getpid())  # a forked child opens its own
        if self.connection is None or self.key != key:
            self._drop()
            self.connection = Connection(
                url,
                connect_timeout=timeout,
                heartbeat=0,  # nobody would send it between reads
                transport_options={"read_timeout": timeout, "write_timeout": timeout},
            )
            self.key = key
            # One attempt, no retry (kombu's connect() retries once, two seconds later).
            self.connection.ensure_connection(max_retries=0)
        if self.channel is None:
            self.channel = self.connection.channel()
        return self.channel

    def _drop(self) -> None:
        connection, self.connection, self.channel = self.connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.collect()  # release the socket without a closing handshake

    def read(self, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """Each queue's ready messages and consumers ((0, 0) if not declared yet), by passive
        declaration; ``BrokerUnreadable`` when RabbitMQ does not answer in time."""
        timeout = asyncwork_settings.PROBE_TIMEOUT_SECONDS
        if not self.lock.acquire(timeout=timeout):
            raise BrokerUnreadable("another read of the broker is under way")
        try:
            found: dict[str, tuple[int, int]] = {}
            for name in names:
                channel = self._channel(str(current_app.conf.broker_url), timeout)
                try:
                    ok = channel.queue_declare(name, passive=True)
                except self.connection.channel_errors:  # type: ignore[union-attr]
                    # Not declared (yet): nothing waits in it. The broker closed the channel.
                    found[name] = (0, 0)
                    self.channel = None
                    continue
                found[name] = (int(ok.message_count), int(ok.consumer_count))
            return found
        except Exception as exc:  # any failure: the connection is not to be trusted again
            self._drop()
            raise BrokerUnreadable(type(exc).__name__) from exc
        finally:
            self.lock.release()


rabbitmq_depths = _Reader().read


@dataclass(frozen=True)
class QueuesProbe:
    """Messages waiting on each queue (not those a worker holds); on RabbitMQ, consumers too."""

    depths: dict[str, int]
    consumers: dict[str, int] | None = None


def queues_probe(names: tuple[str, ...] | None = None) -> QueuesProbe:
    """``names``, by default every watched queue (``broker.watched``): one pipelined round trip on
    Redis; one passive declaration per queue on RabbitMQ (above). Raises
    ``BrokerUnreadable`` (an ``OSError``) when the broker does not answer in time."""
    names = names or broker.watched()
    if broker.rabbitmq():
        read = rabbitmq_depths(names)
        return QueuesProbe(
            depths={name: ready for name, (ready, _) in read.items()},
            consumers={name: consumers for name, (_, consumers) in read.items()},
        )
    client = broker.broker_redis()
    if client is None:
        raise ValueError("the broker is neither Redis nor RabbitMQ")
    keys = {name: broker.queue_keys(name) for name in names}
    try:
        with client.pipeline(transaction=False) as pipe:
            for name in names:
                for key in keys[name]:
                    pipe.llen(key)
            lengths = iter(pipe.execute())
    except redis.RedisError as exc:
        raise BrokerUnreadable(type(exc).__name__) from exc
    return QueuesProbe(depths={name: sum(int(next(lengths)) for _ in keys[name]) for name in names})


class Level(enum.StrEnum):
    NORMAL = "normal"
    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True)
class Pressure:
    """One measurement: ``outbox_backlog`` capped at the hard mark of its time, ``queue_depth``
    waiting on the pressure queues; None where not measurable."""

    outbox_backlog: int | None
    queue_depth: int | None
    measured_at: float  # time.monotonic()

    def level(self) -> Level:
        backlog = max(
            (n for n in (self.outbox_backlog, self.queue_depth) if n is not None), default=None
        )
        if backlog is None or backlog < asyncwork_settings.BACKPRESSURE_SOFT_MARK:
            return Level.NORMAL
        if backlog < asyncwork_settings.BACKPRESSURE_HARD_MARK:
            return Level.SOFT
        return Level.HARD


def pressure_measure() -> Pressure:
    """Measure both figures now; one that cannot be measured is None (and logged)."""
    outbox: int | None = None
    depth: int | None = None
    try:
        outbox = outbox_backlog(now=timezone.now(), cap=asyncwork_settings.BACKPRESSURE_HARD_MARK)
    except DatabaseError as exc:
        logger.warning("backpressure: cannot measure the outbox backlog: %r", exc)
    names = broker.pressure()
    if names:
        try:
            depth = sum(queues_probe(names).depths.values())
        except (BrokerUnreadable, OSError, ValueError) as exc:
            logger.warning("backpressure: cannot measure the broker queues: %r", exc)
    return Pressure(outbox_backlog=outbox, queue_depth=depth, measured_at=time.monotonic())


_last: Pressure | None = None
_measuring = threading.Lock()


def pressure_current() -> Pressure:
    """This process's latest measurement, taken anew when older than ``BACKPRESSURE_CHECK_SECONDS``;
    while another thread measures, the previous one."""
    global _last
    last = _last
    if last and time.monotonic() - last.measured_at < asyncwork_settings.BACKPRESSURE_CHECK_SECONDS:
        return last
    if not _measuring.acquire(blocking=False):
        return last or Pressure(None, None, time.monotonic())
    try:
        _last = pressure_measure()
        return _last
    finally:
        _measuring.release()


def backpressure_shed(*, essential: bool) -> Level | None:
    """The level at which to refuse a request now (``essential``: one we act on), else None."""
    level = pressure_current().level()
    if level is Level.HARD or (level is Level.SOFT and not essential):
        return level
    return None
