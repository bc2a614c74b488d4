"""Recovery at once after a restart, detected by the beat leader on its tick.

A Redis restart with nothing on disk drops every queued message; a PostgreSQL restart fails
the work in flight. The periodic safety nets (``asyncwork.jobs``) find that work at their next
period, minutes later. Here the one beat leader notices the restart within one tick
(``beat.STANDBY_POLL_SECONDS`` at most) and dispatches the jobs the apps declared to run on
recovery (``@job(..., on_recovery=...)``, ``asyncwork.jobs``) at once, through ``jobs_recover``:

* the broker restarted: its ``INFO server`` ``run_id`` differs from the one read at the
  previous tick (a new Redis process, so its memory, the queues, started empty);
* the broker lost its data without restarting (``FLUSHALL``/``FLUSHDB``, a failover to a
  replica that had not caught up): the leader keeps a marker key in the broker's database
  (under the transport's key prefix) and finds it gone;
* the database came back: the leader lost its lock's connection (or a tick failed on the
  database) and then took the lock again in the same process.

Once per restart, not once per worker: only the leader checks, and a leader that has just
started (or taken over from another) only records the run id it sees. A restart the leader
did not see (a new leader with no previous run id) is left to the periodic jobs.
"""

from __future__ import annotations

import logging
import secrets

import redis as redis_py
from django.conf import settings

from asyncwork.broker import broker_redis

logger = logging.getLogger(__name__)

# The key, in the broker's database, whose absence says the broker lost what it held.
MARKER_KEY = "asyncwork:broker-marker"


class BrokerWatch:
    """Remembers the broker's run id and marker, and says when either changed."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.marker: str | None = None

    def restarted(self) -> bool:
        """True once when the broker's run id differs from the one read before, or the marker
        this watch saw is gone (both only say so once: a restart loses the marker too); False
        when nothing changed, at the first read, not on Redis, or unreachable (asked again at
        the next tick)."""
        client = broker_redis()
        if client is None:
            return False
        key = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("global_keyprefix", "") + MARKER_KEY
        try:
            run_id = str(client.info("server")["run_id"])
            stored = client.get(key)
            if stored is None:
                stored_marker = secrets.token_hex(8)
                # Only if still missing: another process (a leader that just took over) may
                # have written one meanwhile.
                client.set(key, stored_marker, nx=True)
                lost = self.marker is not None
            else:
                stored_marker = stored.decode() if isinstance(stored, bytes) else str(stored)
                lost = self.marker is not None and stored_marker != self.marker
        except (redis_py.RedisError, KeyError) as exc:
            logger.debug("broker run id unavailable: %s", exc)
            return False
        previous, self.run_id, self.marker = self.run_id, run_id, stored_marker
        restarted = previous is not None and previous != run_id
        if lost and not restarted:
            logger.warning("the broker lost its data without restarting (its marker is gone)")
        return restarted or lost
