"""The broker: the Celery queues, kombu's Redis transport with one fix, and the broker as the
probes read it.

**The queues** are those the task backend names (``TASKS[alias]["QUEUES"]``, ``default`` when
none is given), read at publish and when a worker starts. A job's first publish goes to its
task's queue. Published again (a retry come due, a rescued run, one the relay sent late), it goes
to the queue read ahead of it: on Redis ``<queue>-recovery``, which a worker reads first
(``queue_order_strategy: priority``, ``asyncwork.install``), so a job that waited is not queued
again behind the backlog that came meanwhile; on RabbitMQ the queue itself, as a second queue
would give every worker a second prefetch window, in which a paused worker swallows the messages
meant to rescue it. On RabbitMQ each queue is a durable quorum queue with a delivery limit, past
which RabbitMQ moves a message onto ``dlq``, which nobody consumes: it waits there for an
operator.

**The Redis transport**: an acknowledgement that fails releases its slot and stops nothing.
kombu's ``QoS.ack`` removes the message from the unacknowledged index, then releases the prefetch
slot; when the removal raises (Redis stalled, or its connection gone after a restart), the slot
is never released, so a prefetch-1 worker fetches nothing for good, and the error reaches Celery,
which takes one it does not know (``AttributeError`` from a channel whose connection was closed)
for unrecoverable and stops the worker. Here the slot is released and the error logged; the
message stays in the index and comes back after the visibility timeout, to find its job done.
Used for ``redis://`` brokers (``broker_transport``, set by ``asyncwork.install``).

**The broker as the probes read it**: a Redis client with short timeouts, and the keys of a
queue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import redis as redis_py
from celery import bootsteps, current_app
from django.conf import settings
from kombu import Exchange, Queue
from kombu.transport import redis, virtual
from kombu.transport.redis import PRIORITY_STEPS
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

DEFAULT = "default"
DLQ = "dlq"
RECOVERY_SUFFIX = "-recovery"
BACKEND = "asyncwork.backend.OutboxBackend"


def rabbitmq() -> bool:
    """Whether the Celery app's broker is RabbitMQ (an ``amqp://`` URL)."""
    return str(current_app.conf.broker_url or "").startswith(("amqp://", "amqps://", "pyamqp://"))


def declared() -> tuple[str, ...]:
    """The queues of every backend of this package, in the order ``TASKS`` lists them."""
    names: dict[str, None] = {}
    for params in (getattr(settings, "TASKS", None) or {}).values():
        if params.get("BACKEND") == BACKEND:
            names.update(dict.fromkeys(params.get("QUEUES") or [DEFAULT]))
    return tuple(names) or (DEFAULT,)


def ahead(name: str) -> str:
    """Where queue ``name``'s jobs go when published again (above)."""
    return name if rabbitmq() else name + RECOVERY_SUFFIX


def consumed() -> tuple[Queue, ...]:
    """What a worker started with no ``-Q`` consumes: each declared queue after the one read
    ahead of it, and ``default`` (Celery's own, where periodic jobs go)."""
    names = [] if DEFAULT in declared() else [DEFAULT]
    for name in declared():
        names += [ahead(name), name]
    return tuple(_declaration(name) for name in dict.fromkeys(names))


def _declaration(name: str) -> Queue:
    """A consumed queue as the broker declares it: on Redis a list; on RabbitMQ a durable quorum
    queue with a delivery limit (past it, onto ``dlq``), bound to a topic exchange of its own,
    through which Celery's delayed delivery routes a delayed message back."""
    if not rabbitmq():
        return Queue(name, Exchange(name), routing_key=name)
    return Queue(
        name,
        Exchange(name, type="topic"),
        routing_key=name,
        durable=True,
        queue_arguments={
            "x-queue-type": "quorum",
            # RabbitMQ's limit counts the deliveries after the first: a message is delivered
            # BROKER_DELIVERY_LIMIT times in all. (A queue declared with another value refuses
            # the declaration: PRECONDITION_FAILED.)
            "x-delivery-limit": asyncwork_settings.BROKER_DELIVERY_LIMIT - 1,
            "x-dead-letter-exchange": DLQ,
            "x-dead-letter-routing-key": DLQ,
        },
    )


def dlq_declaration() -> Queue:
    """``dlq`` on RabbitMQ: a quorum queue behind a direct exchange of its name, declared by every
    worker at start, so a message RabbitMQ dead-letters is never dropped."""
    return Queue(
        DLQ,
        Exchange(DLQ, type="direct"),
        routing_key=DLQ,
        queue_arguments={"x-queue-type": "quorum"},
    )


def watched() -> tuple[str, ...]:
    """The queues whose depth an operator reads: those consumed and, on RabbitMQ, ``dlq``."""
    names = tuple(queue.name for queue in consumed())
    return (*names, DLQ) if rabbitmq() else names


def pressure() -> tuple[str, ...]:
    """The queues whose depth is accepted work not yet done (backpressure, ``/metrics``): every
    declared queue and the one read ahead of it."""
    return tuple(dict.fromkeys(n for name in declared() for n in (ahead(name), name)))


class DeadLetterQueueDeclare(bootsteps.StartStopStep):
    """A consumer step: declare ``dlq`` when connected, before consuming, and on reconnecting."""

    requires = ("celery.worker.consumer.connection:Connection",)

    def include_if(self, parent: Any) -> bool:
        return rabbitmq()

    def start(self, parent: Any) -> None:
        channel = parent.connection.channel()
        try:
            dlq_declaration()(channel).declare()
        finally:
            channel.close()


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
