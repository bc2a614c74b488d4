"""Backpressure: when accepted work is not draining, accept less, in a fixed order.

The signal is the backlog: the larger of

* the unpublished outbox rows (work committed but not yet handed to the broker), and
* the messages waiting on the broker's ``email`` queue (work handed over, not yet done).

Levels, and what is shed at each, in this order:

1. ``normal`` (backlog below ``BACKPRESSURE_SOFT_MARK``): nothing.
2. ``soft`` (at or above the soft mark): the events we do not act on. The caller says which
   events are essential (for the webhook: a payment event in its mode and account); the rest
   are refused with 503 + Retry-After and **not stored**. Payment events are still stored
   durably and then acknowledged.
3. ``hard`` (at or above ``BACKPRESSURE_HARD_MARK``): everything, payment events included,
   503 + Retry-After, nothing stored.

A 200 is only ever sent for an event committed to PostgreSQL: a shed event was never
acknowledged, so the provider delivers it again later (Stripe retries for up to 3 days).
Nothing acknowledged is dropped.

The check is cheap. Each process measures at most once per ``BACKPRESSURE_CHECK_SECONDS`` and
reuses the figures in between; one measurement is a count over the partial index
``outbox_unpublished_idx`` capped at the hard mark (``SELECT count(*) FROM (... LIMIT hard)``,
so its cost stops growing once the backlog passes the hard mark) and one pipelined ``LLEN``
per priority key of the ``email`` queue. The figures are cached, not the level: the marks are
read from settings on every decision.

A figure that cannot be measured (PostgreSQL or Redis down) is unknown, and an unknown figure
sheds nothing: an outage is answered where it bites (the webhook says 503 when it cannot
store; the outbox keeps what it cannot publish), not guessed at here. The email queue depth is
of messages waiting; those a worker holds (reserved, or waiting out a retry countdown) are not
counted.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import DatabaseError
from kombu.transport.redis import PRIORITY_STEPS, Channel
from redis.backoff import NoBackoff
from redis.retry import Retry

from core import queues
from core.models import OutboxMessage

logger = logging.getLogger(__name__)


class Level(enum.StrEnum):
    NORMAL = "normal"
    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True)
class Pressure:
    """One measurement. ``outbox_backlog`` is capped at the hard mark in force when measured;
    None means the figure could not be measured."""

    outbox_backlog: int | None
    email_queue_depth: int | None
    measured_at: float  # time.monotonic()

    @property
    def backlog(self) -> int | None:
        known = [n for n in (self.outbox_backlog, self.email_queue_depth) if n is not None]
        return max(known) if known else None

    def level(self) -> Level:
        backlog = self.backlog
        if backlog is None or backlog < settings.BACKPRESSURE_SOFT_MARK:
            return Level.NORMAL
        if backlog < settings.BACKPRESSURE_HARD_MARK:
            return Level.SOFT
        return Level.HARD


# --- Measuring ---------------------------------------------------------------------------------

_brokers: dict[tuple[str, float], redis.Redis] = {}
_brokers_lock = threading.Lock()


def broker_redis(*, timeout: float | None = None) -> redis.Redis | None:
    """A Redis client for the broker (``settings.CELERY_BROKER_URL``, read now) whose socket
    operations give up after ``timeout`` seconds; None when the broker is not Redis."""
    url = settings.CELERY_BROKER_URL
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    timeout = settings.PROBE_TIMEOUT_SECONDS if timeout is None else timeout
    with _brokers_lock:
        client = _brokers.get((url, timeout))
        if client is None:
            client = _brokers[(url, timeout)] = redis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                # One attempt, whatever redis-py's defaults: a probe that cannot connect
                # once has its answer.
                retry=Retry(NoBackoff(), 0),
            )
    return client


def queue_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps ``queue`` in: one per priority step (``email``,
    ``email\\x06\\x163``, ...), each under the transport's ``global_keyprefix``."""
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    prefix = options.get("global_keyprefix", "")
    steps = options.get("priority_steps", PRIORITY_STEPS)
    # As kombu's Channel._q_for_pri: priority 0 is the bare name.
    return [prefix + (f"{queue}{Channel.sep}{step}" if step else queue) for step in steps]


def queue_depth(queue: str) -> int:
    """Messages waiting on a broker queue (not those reserved by a worker). Raises
    ``redis.RedisError`` when the broker does not answer in time."""
    client = broker_redis()
    if client is None:
        raise redis.RedisError("the broker is not Redis")
    with client.pipeline(transaction=False) as pipe:
        for key in queue_keys(queue):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())


def outbox_backlog(*, cap: int) -> int:
    """Unpublished outbox rows, counted up to ``cap``: the scan of the partial index stops
    there, so the cost is bounded however large the backlog grows."""
    return OutboxMessage.objects.filter(published_at__isnull=True)[:cap].count()


def pressure_measure() -> Pressure:
    """Measure both figures now; a figure that cannot be measured is None (and logged)."""
    outbox: int | None = None
    email: int | None = None
    try:
        outbox = outbox_backlog(cap=settings.BACKPRESSURE_HARD_MARK)
    except DatabaseError as exc:
        logger.warning("backpressure: cannot measure the outbox backlog: %r", exc)
    try:
        email = queue_depth(queues.EMAIL)
    except (redis.RedisError, OSError) as exc:
        logger.warning("backpressure: cannot measure the email queue: %r", exc)
    return Pressure(outbox_backlog=outbox, email_queue_depth=email, measured_at=time.monotonic())


# --- Deciding ----------------------------------------------------------------------------------

_last: Pressure | None = None
_measuring = threading.Lock()


def pressure_current() -> Pressure:
    """This process's latest measurement, taken anew when older than
    ``BACKPRESSURE_CHECK_SECONDS``. While another thread measures, the previous one is used."""
    global _last
    last = _last
    if last is not None and time.monotonic() - last.measured_at < (
        settings.BACKPRESSURE_CHECK_SECONDS
    ):
        return last
    if not _measuring.acquire(blocking=False):
        return last or Pressure(None, None, time.monotonic())
    try:
        _last = pressure_measure()
        return _last
    finally:
        _measuring.release()


def backpressure_shed(*, essential: bool) -> Level | None:
    """The level at which a request is refused now (``essential``: one we act on), or None
    when it is to be accepted."""
    level = pressure_current().level()
    if level is Level.HARD or (level is Level.SOFT and not essential):
        return level
    return None
