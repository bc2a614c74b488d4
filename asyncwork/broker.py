"""kombu's Redis transport with one fix: an acknowledgement that fails releases its slot.

kombu's Redis ``QoS.ack`` removes the message from the unacknowledged index and only then
releases the worker's prefetch slot. When Redis does not answer in time (a stall, a failover),
the removal raises, kombu logs the error and swallows it, and the slot is never released: a
worker with prefetch 1 stays connected and fetches nothing, for good
(``tests/invoicing/test_broker_stall.py`` stalls a Redis under a worker and checks it goes on).

Here the slot is released whatever the removal did. Nothing is lost or doubled by it: a
message whose removal failed stays in the unacknowledged index, comes back after the
visibility timeout, and its redelivery finds the work done (the email's sent key).

Used when the broker URL is ``redis://`` (``CELERY_BROKER_TRANSPORT`` in ``core.settings``).

Besides, the broker as the probes read it: a Redis client with short timeouts, and the keys
kombu keeps a queue in (one list per priority step).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import redis as redis_py
from django.conf import settings
from kombu.transport import redis, virtual
from kombu.transport.redis import PRIORITY_STEPS
from redis.backoff import NoBackoff
from redis.retry import Retry


class QoS(redis.QoS):
    def ack(self, delivery_tag: str) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            if requeue:
                self.restore_by_tag(delivery_tag, leftmost=True)
            else:
                self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        finally:
            virtual.QoS.ack(self, delivery_tag)


class Channel(redis.Channel):
    QoS = QoS

    _kept_client: redis_py.Redis | None = None

    @contextlib.contextmanager
    def conn_or_acquire(self, client: redis_py.Redis | None = None) -> Iterator[redis_py.Redis]:
        """kombu builds a new ``redis.Redis`` on this channel's pool for every command it sends
        outside a pipeline (each publish, each queue-size read), which on redis-py 6+ copies
        every response callback and costs more CPU than the round trip itself. One client per
        channel and pool, kept: a client holds no connection of its own (the pool does), so
        reconnecting after a Redis restart is the pool's, as with kombu's own."""
        if client is not None:
            yield client
            return
        kept = self._kept_client
        pool = self.pool
        if kept is None or kept.connection_pool is not pool:
            kept = self._kept_client = self._create_client()  # type: ignore[attr-defined]
        yield kept


class Transport(redis.Transport):
    Channel = Channel


# --- Reading the broker's queues ----------------------------------------------------------

_brokers: dict[tuple[str, float], redis_py.Redis] = {}
_brokers_lock = threading.Lock()


def broker_redis(*, timeout: float | None = None) -> redis_py.Redis | None:
    """A Redis client for the broker (``settings.CELERY_BROKER_URL``, read now) whose socket
    operations give up after ``timeout`` seconds; None when the broker is not Redis."""
    url = settings.CELERY_BROKER_URL
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    timeout = settings.PROBE_TIMEOUT_SECONDS if timeout is None else timeout
    with _brokers_lock:
        client = _brokers.get((url, timeout))
        if client is None:
            client = _brokers[(url, timeout)] = redis_py.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                # One attempt, whatever redis-py's defaults: a probe that cannot connect
                # once has its answer.
                retry=Retry(NoBackoff(), 0),
            )
    return client


def queue_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps ``queue`` in: one per priority step (``email``,
    ``email\\x06\\x163``, ...), each under the transport's ``global_keyprefix``."""
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    prefix = options.get("global_keyprefix", "")
    steps = options.get("priority_steps", PRIORITY_STEPS)
    # As kombu's Channel._q_for_pri: priority 0 is the bare name.
    return [prefix + (f"{queue}{redis.Channel.sep}{step}" if step else queue) for step in steps]
