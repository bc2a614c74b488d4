"""Backpressure: when accepted work is not draining, accept less, in a fixed order.

The signal is the backlog: the larger of

* the unpublished outbox rows (work committed but not yet handed to the broker), and
* the messages waiting on the pressure queues, those an app declared with
  ``queue_declare(..., pressure=True)`` (work handed over, not yet done).

Levels, and what is shed at each, in this order:

1. ``normal`` (backlog below ``BACKPRESSURE_SOFT_MARK``): nothing.
2. ``soft`` (at or above the soft mark): what is not essential. The caller says what is (the
   webhook: an event type with a registered handler, in its mode and account); the rest is
   refused with 503 + Retry-After and **not stored**. Essential work is still stored durably
   and then acknowledged.
3. ``hard`` (at or above ``BACKPRESSURE_HARD_MARK``): everything, 503 + Retry-After, nothing
   stored.

A 200 is only ever sent for work committed to PostgreSQL: what is shed was never
acknowledged, so the sender delivers it again later. Nothing acknowledged is dropped.

The check is cheap and measures nothing of its own: each process reads the outbox backlog and
the queue probe (``asyncwork.probes``, the figures ``/health/``, ``/metrics`` and the dashboard
show) at most once per ``BACKPRESSURE_CHECK_SECONDS``, and reuses the figures in between. The
outbox count is capped at the hard mark, so its cost stops growing once the backlog passes it
(and it is the count alone: not the probe's oldest row, which reads the whole backlog). The
figures are cached, not the level: the marks are read from settings on every decision.

A figure that cannot be measured (PostgreSQL or the broker down) is unknown, and an unknown figure
sheds nothing: an outage is answered where it bites (the webhook says 503 when it cannot
store; the outbox keeps what it cannot publish), not guessed at here. A queue's depth is of
messages waiting; those a worker holds (reserved, or waiting out a retry countdown) are not
counted.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from asyncwork import queues
from asyncwork.probes import BrokerUnreadable, outbox_backlog, queues_probe

logger = logging.getLogger(__name__)


class Level(enum.StrEnum):
    NORMAL = "normal"
    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True)
class Pressure:
    """One measurement. ``outbox_backlog`` is capped at the hard mark in force when measured;
    ``queue_depth`` is the messages waiting on the pressure queues; None means the figure could
    not be measured."""

    outbox_backlog: int | None
    queue_depth: int | None
    measured_at: float  # time.monotonic()

    @property
    def backlog(self) -> int | None:
        known = [n for n in (self.outbox_backlog, self.queue_depth) if n is not None]
        return max(known) if known else None

    def level(self) -> Level:
        backlog = self.backlog
        if backlog is None or backlog < settings.BACKPRESSURE_SOFT_MARK:
            return Level.NORMAL
        if backlog < settings.BACKPRESSURE_HARD_MARK:
            return Level.SOFT
        return Level.HARD


# --- Measuring ---------------------------------------------------------------------------------


def pressure_measure() -> Pressure:
    """Measure both figures now, through the probes ``/health/``, ``/metrics`` and the dashboard
    read; a figure that cannot be measured is None (and logged)."""
    outbox: int | None = None
    depth: int | None = None
    try:
        outbox = outbox_backlog(now=timezone.now(), cap=settings.BACKPRESSURE_HARD_MARK)
    except DatabaseError as exc:
        logger.warning("backpressure: cannot measure the outbox backlog: %r", exc)
    names = queues.pressure_queues()
    if names:
        try:
            depth = sum(queues_probe(names).depths.values())
        except (BrokerUnreadable, OSError, ValueError) as exc:
            logger.warning("backpressure: cannot measure the broker queues: %r", exc)
    return Pressure(outbox_backlog=outbox, queue_depth=depth, measured_at=time.monotonic())


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
