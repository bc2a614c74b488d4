"""RabbitMQ's queues as the probes read them: each queue's ready messages and consumers, by
passive declaration, on one connection per process kept between reads. Nothing here runs on
Redis (``asyncwork.broker`` reads its lists)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from celery import current_app
from kombu import Connection

from asyncwork.settings import asyncwork_settings


class BrokerUnreadable(ConnectionError):
    """The broker did not answer a read of its queues in time (or refused the connection)."""


class _Reader:
    """One AMQP connection per process, kept and reopened after any error, with socket timeouts of
    ``PROBE_TIMEOUT_SECONDS``. One read at a time (AMQP connections are not for sharing threads);
    a caller that cannot have it within the timeout gets ``BrokerUnreadable``."""

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
        """Each queue's ready messages and consumers ((0, 0) if not declared yet), by passive
        declaration; ``BrokerUnreadable`` when RabbitMQ does not answer in time."""
        timeout = asyncwork_settings.PROBE_TIMEOUT_SECONDS
        if not self.lock.acquire(timeout=timeout):
            raise BrokerUnreadable("another read of the broker is under way")
        try:
            found: dict[str, tuple[int, int]] = {}
            for name in names:
                channel = self._channel(str(current_app.conf.broker_url), timeout)
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


queue_depths = _Reader().read
