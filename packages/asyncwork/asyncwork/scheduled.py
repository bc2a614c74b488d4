"""Every worker publishes the retries and deferrals that have come due (outbox rows with a due time,
``outbox_schedule``): a thread in its main process (a bootstep, ``core.celery``) runs
``outbox_publish_due`` every ``DUE_POLL_SECONDS``. Workers split the rows (``SKIP LOCKED``), so
retries go out while any worker runs; the relay takes what the polls missed.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from asyncwork.periodic import PeriodicThread

logger = logging.getLogger(__name__)

# A retry waits its backoff to within this, for one indexed query per poll when none is due.
DUE_POLL_SECONDS = 1.0


class DuePoll(PeriodicThread):
    """One worker's poll thread, on database and broker connections of its own."""

    def __init__(self, *, interval: float) -> None:
        super().__init__(
            name="asyncwork-due-poll",
            interval=interval,
            logger=logger,
            failed="due retries not published: %s",
        )

    def tick(self) -> None:
        from asyncwork.outbox import outbox_publish_due  # models are loaded by now

        published = self.guarded(outbox_publish_due, 0)
        if published:
            logger.info("published %d retry(s) come due", published, extra={"published": published})


class OutboxDuePoll(bootsteps.StartStopStep):
    label = "OutboxDuePoll"
    poll: DuePoll | None = None

    def start(self, parent: Any) -> None:
        self.poll = DuePoll(interval=DUE_POLL_SECONDS)
        self.poll.start()

    def stop(self, parent: Any) -> None:
        if self.poll is not None:
            self.poll.stop()
            self.poll = None

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
