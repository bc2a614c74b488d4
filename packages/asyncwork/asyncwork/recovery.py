"""Recovery at once after a restart, detected by the beat leader on its tick: it dispatches the jobs
declared ``on_recovery`` (``jobs_recover``) when

* the broker's ``run_id`` changed (a new Redis process: its queues started empty);
* a marker key it keeps in the broker's database is gone (``FLUSHALL``, a failover to a replica
  behind).

Only the leader checks, so once per restart; a new leader only records the run id, leaving a
restart it did not see to the periodic jobs.
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
        """True once when the run id changed or the marker this watch saw is gone; False when
        nothing changed, at the first read, not on Redis, or unreachable (asked again next tick)."""
        client = broker_redis()
        if client is None:
            return False
        key = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("global_keyprefix", "") + MARKER_KEY
        try:
            run_id = str(client.info("server")["run_id"])
            stored = client.get(key)
            if stored is None:
                stored_marker = secrets.token_hex(8)
                # Only if still missing: a leader that just took over may have written one.
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
