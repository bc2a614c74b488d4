"""Backpressure: when accepted work is not draining, accept less, in a fixed order.

The backlog is the larger of the unpublished outbox rows and the messages waiting on the pressure
queues (``queue_declare(..., pressure=True)``). Below ``BACKPRESSURE_SOFT_MARK`` nothing is shed;
at the soft mark, what the caller says is not essential is refused with 503 + Retry-After and not
stored; at ``BACKPRESSURE_HARD_MARK``, everything. A 200 is only sent for work committed to
PostgreSQL, so what is shed is delivered again later by its sender: nothing acknowledged is
dropped.

Each process reads the figures through the probes at most once per ``BACKPRESSURE_CHECK_SECONDS``;
the outbox count is capped at the hard mark, so its cost stops growing. A figure that cannot be
measured (PostgreSQL or the broker down) sheds nothing: an outage is answered where it bites.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

from django.db import DatabaseError
from django.utils import timezone

from asyncwork import queues
from asyncwork.contrib.monitoring.probes import (
    BrokerUnreadable,
    CheckResult,
    Probe,
    outbox_backlog,
    probe_declare,
    queues_probe,
)
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)


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
    names = queues.pressure()
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


def backpressure_check(pressure: Pressure) -> CheckResult:
    level = pressure.level()
    status = {"normal": "ok", "soft": "degraded", "hard": "failing"}[level]
    if pressure.queue_depth is None and pressure.outbox_backlog is None:
        status = "unknown"
    return {
        "status": status,
        "level": str(level),
        "queue_depth": pressure.queue_depth,
        "outbox_backlog": pressure.outbox_backlog,
        "soft_mark": asyncwork_settings.BACKPRESSURE_SOFT_MARK,
        "hard_mark": asyncwork_settings.BACKPRESSURE_HARD_MARK,
        "queues": list(queues.pressure()),
    }


probe_declare(Probe("backpressure", pressure_measure, database=False, check=backpressure_check))
