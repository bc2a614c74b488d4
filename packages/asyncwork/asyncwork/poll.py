"""Every worker's poll: a thread in its main process (a bootstep, ``asyncwork.install``) that
each ``POLL_SECONDS`` publishes the jobs come due and those whose publish failed
(``backend.relay``) or the broker lost (``recovery``), and every ``RESCUE_EVERY`` gives back what
dead workers held (``rescue.workers_rescue``). So a worker alone holds every guarantee: no other
process needs to run for a job whose publish failed at commit, or whose worker died, to run.
Workers split the rows (``SKIP LOCKED``), so each runs while any worker does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps

from asyncwork.periodic import PeriodicThread

logger = logging.getLogger(__name__)

# A job waits its due time to within this, for one indexed query per poll when none is due.
POLL_SECONDS = 1.0
# How often the jobs published long ago and never started are looked for.
UNSTARTED_EVERY_SECONDS = 60.0


class Poll(PeriodicThread):
    """One worker's poll thread, on database and broker connections of its own."""

    def __init__(self, *, interval: float) -> None:
        super().__init__(
            name="asyncwork-poll",
            interval=interval,
            logger=logger,
            failed="jobs not published, nor workers rescued: %s",
            recovered="jobs published and workers rescued again",
        )
        self.rescued_at = 0.0
        self.swept_at = time.monotonic()
        self.broker: Any = None

    def tick(self) -> None:
        # The models are loaded by the first tick.
        from asyncwork.backend import relay
        from asyncwork.recovery import BrokerWatch, jobs_republish_lost, jobs_republish_unstarted
        from asyncwork.rescue import RESCUE_EVERY, workers_rescue

        if self.broker is None:
            self.broker = BrokerWatch()
        if self.broker.restarted():
            self.guarded(jobs_republish_lost, 0)
        self.guarded(relay, 0)
        if time.monotonic() - self.rescued_at >= RESCUE_EVERY.total_seconds():
            self.rescued_at = time.monotonic()
            self.guarded(workers_rescue, dict[str, int]())
        if time.monotonic() - self.swept_at >= UNSTARTED_EVERY_SECONDS:
            self.swept_at = time.monotonic()
            self.guarded(jobs_republish_unstarted, 0)


class PollStep(bootsteps.StartStopStep):
    label = "Poll"
    poll: Poll | None = None

    def start(self, parent: Any) -> None:
        self.poll = Poll(interval=POLL_SECONDS)
        self.poll.start()

    def stop(self, parent: Any) -> None:
        if self.poll is not None:
            self.poll.stop()
            self.poll = None

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
