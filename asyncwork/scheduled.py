"""Every worker publishes the retries and deferrals that have come due.

A job's retry or deferral waits as an outbox row with a due time (``asyncwork.tasks``,
``asyncwork.outbox.outbox_schedule``). A thread in each worker's main process (a worker
bootstep, added in ``core.celery``) publishes the rows that have come due, every
``DUE_POLL_SECONDS``: one indexed query when none is due. Many workers poll at once
and split the rows between them (``FOR UPDATE SKIP LOCKED``), so the retries go out as long as
any worker runs, and a worker that dies takes no waiting retry with it. The relay job
publishes any row the polls missed.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from asyncwork.periodic import PeriodicThread

logger = logging.getLogger(__name__)

# Each worker publishes the rows come due this often: a retry waits its backoff to within a
# second, for one indexed query a second when none is due.
DUE_POLL_SECONDS = 1.0


class DuePoll(PeriodicThread):
    """The poll thread of one worker: publishes due rows every ``interval`` seconds, on a
    database connection and a broker connection of its own."""

    def __init__(self, *, interval: float) -> None:
        super().__init__(
            name="asyncwork-due-poll",
            interval=interval,
            logger=logger,
            failed="due retries not published: %s",
        )

    def poll(self) -> int:
        from asyncwork.outbox import outbox_publish_due  # models are loaded by now

        published = self.guarded(outbox_publish_due, 0)
        if published:
            logger.info("published %d retry(s) come due", published, extra={"published": published})
        return published

    def tick(self) -> None:
        self.poll()


class OutboxDuePoll(bootsteps.StartStopStep):
    """The worker's due poll, from its start to its stop."""

    label = "OutboxDuePoll"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.poll: DuePoll | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        self.poll = DuePoll(interval=DUE_POLL_SECONDS)
        self.poll.start()

    def stop(self, parent: Any) -> None:
        if self.poll is not None:
            self.poll.stop()
            self.poll = None

    def terminate(self, parent: Any) -> None:
        self.stop(parent)
