"""kombu's Redis transport with one fix: an acknowledgement that fails releases its slot and
stops nothing.

kombu's ``QoS.ack`` removes the message from the unacknowledged index, then releases the prefetch
slot; when the removal raises (Redis stalled, or its connection gone after a restart), the slot
is never released, so a prefetch-1 worker fetches nothing for good, and the error reaches Celery,
which takes one it does not know (``AttributeError`` from a channel whose connection was closed)
for unrecoverable and stops the worker. Here the slot is released and the error logged; the
message stays in the index and comes back after the visibility timeout, to find its job done.
Used for ``redis://`` brokers (``broker_transport``, set by ``asyncwork.install``).

Also the broker as the probes read it: a Redis client with short timeouts, and the keys of a
queue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import redis as redis_py
from celery import current_app
from kombu.transport import redis, virtual
from kombu.transport.redis import PRIORITY_STEPS
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)


# What an acknowledgement meets when Redis is not there: a refused or cut connection, or the
# channel of one already closed (its client is None).
_UNREACHABLE = (redis_py.RedisError, OSError, AttributeError)


class QoS(redis.QoS):
    def ack(self, delivery_tag: str) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        except _UNREACHABLE as exc:
            logger.warning("acknowledgement not written, the message comes back later: %r", exc)
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            if requeue:
                self.restore_by_tag(delivery_tag, leftmost=True)
            else:
                self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        except _UNREACHABLE as exc:
            logger.warning("rejection not written, the message comes back later: %r", exc)
        finally:
            virtual.QoS.ack(self, delivery_tag)


class Channel(redis.Channel):
    QoS = QoS

    _kept_client: redis_py.Redis | None = None

    @contextlib.contextmanager
    def conn_or_acquire(self, client: redis_py.Redis | None = None) -> Iterator[redis_py.Redis]:
        """One ``redis.Redis`` per channel and pool, kept: kombu builds one per command outside a
        pipeline, costing more CPU than the round trip. Reconnecting is still the pool's."""
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


_brokers: dict[tuple[str, float], redis_py.Redis] = {}
_brokers_lock = threading.Lock()


def broker_redis() -> redis_py.Redis | None:
    """The broker's Redis client, ``PROBE_TIMEOUT_SECONDS`` socket timeouts; None if not Redis."""
    url = str(current_app.conf.broker_url or "")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    timeout = asyncwork_settings.PROBE_TIMEOUT_SECONDS
    with _brokers_lock:
        client = _brokers.get((url, timeout))
        if client is None:
            client = _brokers[(url, timeout)] = redis_py.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                # One attempt: a probe that cannot connect has its answer.
                retry=Retry(NoBackoff(), 0),
            )
    return client


def queue_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps ``queue`` in, one per priority, under ``global_keyprefix``."""
    options = current_app.conf.broker_transport_options or {}
    prefix = options.get("global_keyprefix", "")
    steps = options.get("priority_steps", PRIORITY_STEPS)
    # As kombu's Channel._q_for_pri: priority 0 is the bare name.
    return [prefix + (f"{queue}{redis.Channel.sep}{step}" if step else queue) for step in steps]
