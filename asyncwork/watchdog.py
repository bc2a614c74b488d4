"""The worker's watchdog: no worker stays idle while its queues hold work.

A worker can live and consume nothing (its event loop died, its consumer lost its prefetch slots
or its connection), and its supervisor restarts nothing. A thread in the main process (a
bootstep, ``core.celery``) looks once a second: when for ``WORKER_WATCHDOG_SECONDS`` on end the
worker had a free slot, its queues held messages and it accepted no task, it logs one CRITICAL
line, counts it (``asyncwork_worker_watchdog_actions``) and exits with ``EXIT_CODE`` for the
supervisor to restart it; re-establishing a consumer from outside its event loop is not safe. The
held messages come back (``acks_late``, ``reject_on_worker_lost``).

A broker it cannot read is no evidence against the worker: the watch starts over.
``WORKER_WATCHDOG_SECONDS=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import bootsteps
from celery.worker import state
from django.conf import settings
from prometheus_client import Counter

from asyncwork.broker import broker_redis

logger = logging.getLogger(__name__)

WATCHDOG_ACTIONS = Counter(
    "asyncwork_worker_watchdog_actions",
    "Times a worker's watchdog found it idle with work waiting (or its consumer dead), by "
    "action: exit (the worker exited for its supervisor to restart it).",
    ["action"],
)
EXIT_CODE = 70  # EX_SOFTWARE: the worker gave up on itself
INTERVAL_SECONDS = 1.0


def queued(queues: list[str]) -> int | None:
    """Messages waiting in ``queues``, or None if the broker does not answer."""
    # Imported here: this module loads with Celery's app, before Django's apps, and the probes
    # import models.
    from asyncwork.probes import queues_probe

    try:
        return sum(queues_probe(tuple(queues)).depths.values())
    except (OSError, ValueError):  # the probes' BrokerUnreadable is an OSError
        return None


class Watch:
    """The watchdog's state: since when the worker has been idle with work waiting."""

    def __init__(self, *, concurrency: int, queues: list[str], seconds: float) -> None:
        self.concurrency = concurrency
        self.queues = queues
        self.seconds = seconds
        self.since: float | None = None
        self.accepted = -1
        self.waiting = 0

    def stuck(self, now: float) -> bool:
        """One look; True once the worker has been idle with work waiting for ``seconds``."""
        accepted = state.all_total_count[0]
        free = len(state.reserved_requests) < self.concurrency
        waiting = queued(self.queues) if free else None
        if not waiting or accepted != self.accepted:
            self.since, self.accepted = None, accepted
            return False
        self.waiting = waiting
        if self.since is None:
            self.since = now
        return now - self.since >= self.seconds


class WorkerWatchdog(bootsteps.StartStopStep):
    """Starts the watchdog thread with the worker, stops it with the worker."""

    label = "Watchdog"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.stopping = threading.Event()

    def start(self, parent: Any) -> None:
        seconds = settings.WORKER_WATCHDOG_SECONDS
        if seconds <= 0 or (broker_redis() is None and not settings.BROKER_IS_RABBITMQ):
            return
        # The queues it was started on: a consumer cancelled since is a stuck consumer too.
        queues = sorted(parent.app.amqp.queues.consume_from)
        watch = Watch(concurrency=parent.concurrency, queues=queues, seconds=seconds)
        threading.Thread(
            target=self.run, args=(watch,), name="asyncwork-watchdog", daemon=True
        ).start()

    def stop(self, parent: Any) -> None:
        self.stopping.set()

    def run(self, watch: Watch) -> None:
        while not self.stopping.wait(INTERVAL_SECONDS):
            if watch.stuck(time.monotonic()):
                self.give_up(watch)
                return

    def give_up(self, watch: Watch) -> None:
        WATCHDOG_ACTIONS.labels(action="exit").inc()
        logger.critical(
            "worker watchdog: a free slot while %d message(s) waited in %s and no task was "
            "taken for %.0f s: the consumer is stuck; exiting (%d) for the supervisor to "
            "restart the worker",
            watch.waiting,
            ", ".join(watch.queues),
            watch.seconds,
            EXIT_CODE,
            extra={"queues": watch.queues, "waiting": watch.waiting},
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        # Not sys.exit (not the main thread) nor a warm shutdown (a stuck worker may not finish
        # one).
        os._exit(EXIT_CODE)
