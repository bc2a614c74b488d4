"""The control arm's Celery app: the project's (``core.celery``), its workers' poll reduced to
the relay. Jobs are published when their transaction commits and when they come due (a
retry's backoff), as in the safe arm; but no worker gives back the jobs of a worker that died
(``asyncwork.rescue``) nor publishes again what the broker lost (``asyncwork.recovery``). With
``chaos.unsafe_settings`` (early acknowledgement) that is the pipeline without its safety nets.
"""

from __future__ import annotations

from typing import Any

from asyncwork.poll import POLL_SECONDS, Poll, PollStep
from core.celery import app

__all__ = ["app"]


class RelayOnly(Poll):
    def tick(self) -> None:
        from asyncwork.backend import relay  # the models are loaded by the first tick

        self.guarded(relay, 0)


class RelayOnlyStep(PollStep):
    def start(self, parent: Any) -> None:
        self.poll = RelayOnly(interval=POLL_SECONDS)
        self.poll.start()


app.steps["worker"].discard(PollStep)
app.steps["worker"].add(RelayOnlyStep)
