"""Jobs the broker lost, published again: every worker's poll (``asyncwork.poll``) watches the
broker, and when

* the broker's ``run_id`` changed (a new Redis process: its queues started empty), or
* a marker key it keeps in the broker's database is gone (``FLUSHALL``, a failover to a replica
  behind),

every job published and not started is published again (``jobs_republish_lost``). A message that
survived finds its job claimed or done, and does nothing. Nothing of that runs on RabbitMQ, whose
quorum queues keep their messages. On any broker, a job published long ago and never started is
published again (``jobs_republish_unstarted``): a message lost on its own.
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta

import redis as redis_py
from celery import current_app
from django.db.models.functions import Now

from asyncwork.broker import broker_redis
from asyncwork.models import Job
from asyncwork.settings import asyncwork_settings

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
        options = current_app.conf.broker_transport_options or {}
        key = options.get("global_keyprefix", "") + MARKER_KEY
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


def jobs_republish_lost() -> int:
    """Publish again every job published and not started: the broker lost its messages."""
    lost = Job.objects.filter(status=Job.Status.READY, published_at__isnull=False).update(
        published_at=None, due_at=Now()
    )
    logger.warning(
        "the broker lost its messages: %d job(s) published and not started are published again",
        lost,
        extra={"republished": lost},
    )
    return lost


def jobs_republish_unstarted() -> int:
    """Publish again the jobs published ``REPUBLISH_UNSTARTED_SECONDS`` ago and still not started:
    their message may be gone without the broker restarting (a queue purged; a message a killed
    consumer took after it had waited, which the rescue does not look for). Under a backlog that
    old, a second message for a job is taken and does nothing."""
    since = Now() - timedelta(seconds=asyncwork_settings.REPUBLISH_UNSTARTED_SECONDS)
    stale = Job.objects.filter(status=Job.Status.READY, published_at__lt=since)
    republished = stale.update(published_at=None, due_at=Now())
    if republished:
        logger.warning(
            "%d job(s) published long ago and never started are published again",
            republished,
            extra={"republished": republished},
        )
    return republished
