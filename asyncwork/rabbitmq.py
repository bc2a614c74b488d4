"""What RabbitMQ as the broker needs besides the queues' declarations (``asyncwork.queues``):
``dlq`` declared by every worker as it starts.

The consumed queues dead-letter a message delivered too often onto ``dlq``; RabbitMQ drops a
dead-lettered message that no queue is bound to take, and nothing else declares ``dlq``.

And the broker as the probes, backpressure, ``/health/`` and the worker's watchdog read it
(``queue_depths``), as ``asyncwork.broker`` reads Redis. Nothing here runs on Redis.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from celery import bootsteps
from django.conf import settings
from kombu import Connection

from asyncwork import queues


class DeadLetterQueueDeclare(bootsteps.StartStopStep):
    """A worker's consumer step: declare ``dlq`` once connected, before consuming (and again
    after every reconnection, which a queue deleted meanwhile needs)."""

    requires = ("celery.worker.consumer.connection:Connection",)

    def include_if(self, parent: Any) -> bool:
        return bool(settings.BROKER_IS_RABBITMQ)

    def start(self, parent: Any) -> None:
        channel = parent.connection.channel()
        try:
            queues.dlq_declaration()(channel).declare()
        finally:
            channel.close()


# --- Reading the broker's queues ----------------------------------------------------------


class BrokerUnreadable(ConnectionError):
    """RabbitMQ did not answer a read of its queues in time (or refused the connection)."""


class _Reader:
    """One AMQP connection per process, kept between reads and opened again after any error,
    whose socket reads and writes give up after ``PROBE_TIMEOUT_SECONDS``. AMQP connections
    are not for sharing between threads: one read at a time, and a caller that cannot have the
    connection within the timeout gets ``BrokerUnreadable`` rather than a wait."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connection: Connection | None = None
        self.channel: Any = None
        self.key: tuple[str, float, int] | None = None

    def _channel(self, url: str, timeout: float) -> Any:
        key = (url, timeout, os.getpid())  # a forked child opens its own
        if self.connection is None or self.key != key:
            self._drop()
            self.connection = Connection(
                url,
                connect_timeout=timeout,
                heartbeat=0,  # nobody would send it between reads
                transport_options={"read_timeout": timeout, "write_timeout": timeout},
            )
            self.key = key
            # One attempt, no retry (kombu's connect() retries once, two seconds later).
            self.connection.ensure_connection(max_retries=0)
        if self.channel is None:
            self.channel = self.connection.channel()
        return self.channel

    def _drop(self) -> None:
        connection, self.connection, self.channel = self.connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.collect()  # release the socket without a closing handshake

    def read(self, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        timeout = settings.PROBE_TIMEOUT_SECONDS
        if not self.lock.acquire(timeout=timeout):
            raise BrokerUnreadable("another read of the broker is under way")
        try:
            found: dict[str, tuple[int, int]] = {}
            for name in names:
                channel = self._channel(settings.CELERY_BROKER_URL, timeout)
                try:
                    ok = channel.queue_declare(name, passive=True)
                except self.connection.channel_errors:  # type: ignore[union-attr]
                    # Not declared (yet): nothing waits in it. The broker closed the channel.
                    found[name] = (0, 0)
                    self.channel = None
                    continue
                found[name] = (int(ok.message_count), int(ok.consumer_count))
            return found
        except Exception as exc:  # any failure: the connection is not to be trusted again
            self._drop()
            raise BrokerUnreadable(type(exc).__name__) from exc
        finally:
            self.lock.release()


_reader = _Reader()


def queue_depths(names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each queue's messages ready (not those a worker holds) and consumers, as a passive
    declaration tells them: one round trip per queue on a kept connection, no management
    plugin. A queue not declared yet counts (0, 0). Raises ``BrokerUnreadable`` when RabbitMQ
    does not answer within ``PROBE_TIMEOUT_SECONDS``."""
    return _reader.read(names)


def broker_ping() -> None:
    """Raises ``BrokerUnreadable`` unless RabbitMQ answers a passive declaration of ``dlq``
    (declared by every worker) within ``PROBE_TIMEOUT_SECONDS``."""
    _reader.read((queues.DLQ,))
