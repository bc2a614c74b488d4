"""Recovery at once after a restart, detected by the beat leader on its tick.

A Redis restart with nothing on disk drops every queued message; a PostgreSQL restart fails
the work in flight. The periodic safety nets (``asyncwork.jobs``) find that work at their next
period, minutes later. Here the one beat leader notices the restart within one tick
(``BEAT_STANDBY_POLL_SECONDS`` at most) and dispatches the jobs the apps declared to run on
recovery (``job_register(..., on_recovery=...)``) at once, through ``jobs_recover``:

* the broker restarted: its ``INFO server`` ``run_id`` differs from the one read at the
  previous tick (a new Redis process, so its memory, the queues, started empty);
* the database came back: the leader lost its lock's connection (or a tick failed on the
  database) and then took the lock again in the same process.

Once per restart, not once per worker: only the leader checks, and a leader that has just
started (or taken over from another) only records the run id it sees. A restart the leader
did not see (a new leader with no previous run id) is left to the periodic jobs.
"""

from __future__ import annotations

import logging

import redis as redis_py

from asyncwork.broker import broker_redis

logger = logging.getLogger(__name__)


class BrokerWatch:
    """Remembers the broker's run id and says when it changed."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def restarted(self) -> bool:
        """True once when the broker's run id differs from the one read before; False when
        it is the same, the first read, not Redis, or unreachable (asked again next tick)."""
        client = broker_redis()
        if client is None:
            return False
        try:
            run_id = str(client.info("server")["run_id"])
        except (redis_py.RedisError, KeyError) as exc:
            logger.debug("broker run id unavailable: %s", exc)
            return False
        previous, self.run_id = self.run_id, run_id
        return previous is not None and previous != run_id
