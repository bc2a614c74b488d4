"""The Celery queues: those the task backend names (``TASKS[alias]["QUEUES"]``, ``default`` when
none is given), read at publish and when a worker starts.

A job's first publish goes to its task's queue. Published again (a retry come due, a rescued run,
one the relay sent late), it goes to the queue read ahead of it: on Redis ``<queue>-recovery``,
which a worker reads first (``queue_order_strategy: priority``, ``asyncwork.install``), so a job
that waited is not queued again behind the backlog that came meanwhile; on RabbitMQ the queue
itself, as a second queue would give every worker a second prefetch window, in which a paused
worker swallows the messages meant to rescue it.

On RabbitMQ each queue is a durable quorum queue with a delivery limit, past which RabbitMQ moves
a message onto ``dlq``, which nobody consumes: it waits there for an operator.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps, current_app
from django.conf import settings
from kombu import Exchange, Queue

from asyncwork.settings import asyncwork_settings

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
