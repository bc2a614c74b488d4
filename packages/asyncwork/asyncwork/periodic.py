"""A worker's periodic database thread (the heartbeat's, the due poll's), on a connection of its
own. A tick the database refuses closes the connection; an outage is logged when it starts and
when it ends, not per tick. Imports no model: the poll loads with the Celery app, before
Django's models.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from django.db import DatabaseError, connection

T = TypeVar("T")


class PeriodicThread:
    """``tick`` every ``interval`` s on daemon thread ``name``, ``at_stop`` once, one connection."""

    def __init__(
        self,
        *,
        name: str,
        interval: float,
        logger: logging.Logger,
        failed: str,
        recovered: str = "",
        at_once: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.interval = interval
        self.logger = logger
        self.failed = failed  # "<what> not done: %s", logged when the failures start
        self.recovered = recovered  # logged when they end, if given
        self.at_once = at_once
        self.extra = dict(extra or {})
        self.stopping = threading.Event()
        self.failing = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(self.interval + 5)

    def tick(self) -> None:
        raise NotImplementedError

    def at_stop(self) -> None:
        """What the thread does once stopped, before closing its connection."""

    def guarded(self, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` if the database refused it (logged once per outage)."""
        try:
            result = call()
        except DatabaseError as exc:
            connection.close()  # a new connection next tick
            if not self.failing:
                self.logger.warning(self.failed, exc, extra=self.extra)
            self.failing = True
            return default
        if self.failing and self.recovered:
            self.logger.info(self.recovered, extra=self.extra)
        self.failing = False
        return result

    def _run(self) -> None:
        try:
            if self.at_once:
                self.tick()
            while not self.stopping.wait(self.interval):
                self.tick()
            self.at_stop()
        finally:
            connection.close()
