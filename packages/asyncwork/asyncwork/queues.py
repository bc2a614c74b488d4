"""The Celery queues and every task's route: one registry, read at publish and at worker start.

``default`` holds the scheduled jobs. ``dlq`` is RabbitMQ's, consumed by nobody: a message
delivered past its queue's delivery limit waits there for an operator. Apps declare their queues
beside their tasks (``queue_declare``); a ``pressure`` queue's depth is work accepted and not
done. A worker reads ``default``, then the declared queues in order (strictly on Redis); a queue
declared ``ahead_of`` another is read before it, so work enqueued again does not wait behind the
backlog (on RabbitMQ it is folded into the other).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from kombu import Exchange, Queue

from asyncwork.settings import asyncwork_settings

DEFAULT = "default"
DLQ = "dlq"

_queues: dict[str, bool] = {}  # name -> counts toward backpressure
_routes: dict[str, str] = {}  # task name -> queue
_folded: dict[str, str] = {}  # a queue this broker cannot read first -> the queue used instead
_ahead: dict[str, str] = {}  # a queue -> the queue read ahead of it (its recovered work)


def queue_declare(
    name: str, *, pressure: bool = False, ahead_of: str | None = None, tasks: Iterable[str] = ()
) -> str:
    """Declare queue ``name`` (returned) and route ``tasks`` to it; a worker without ``-Q`` reads it
    after the queues declared before it. With ``ahead_of``, it is read before that queue; on
    RabbitMQ it is folded into it (``queue_resolve``): a second queue would give every worker a
    second prefetch window, in which a paused worker swallows the messages meant to rescue it."""
    if name in (DEFAULT, DLQ):
        raise ValueError(f"queue {name!r} is the machinery's own")
    for task in tasks:
        _routes[task] = name
    if ahead_of is None:
        _queues[name] = pressure
        return name
    if ahead_of not in _queues:
        raise ValueError(f"queue {ahead_of!r} is not declared")
    _ahead[ahead_of] = name
    if asyncwork_settings.BROKER_IS_RABBITMQ:
        _folded[name] = ahead_of
        return name
    declared = list(_queues.items())
    at = list(_queues).index(ahead_of)
    _queues.clear()
    _queues.update([*declared[:at], (name, pressure), *declared[at:]])
    return name


def queue_resolve(name: str) -> str:
    """The queue a message for ``name`` goes to on this broker (``queue_declare``)."""
    return _folded.get(name, name)


def queue_ahead(name: str) -> str:
    """Where queue ``name``'s recovered work goes: the queue ahead of it (resolved), or ``name``."""
    return queue_resolve(_ahead.get(name, name))


def consumed() -> tuple[Queue, ...]:
    """What a worker started with no ``-Q`` consumes: ``default`` and every declared queue."""
    return tuple(_declaration(name) for name in (DEFAULT, *_queues))


def _declaration(name: str) -> Queue:
    """A consumed queue as the broker declares it: on Redis a list; on RabbitMQ a durable quorum
    queue with a delivery limit (past it, onto ``dlq``), bound to a topic exchange of its own,
    through which Celery's delayed delivery routes a delayed message back."""
    if not asyncwork_settings.BROKER_IS_RABBITMQ:
        return Queue(name)
    return Queue(
        name,
        Exchange(name, type="topic"),
        routing_key=name,
        durable=True,
        queue_arguments={
            "x-queue-type": "quorum",
            # Delivered this many times plus one: on the last delivery a worker dead-letters the
            # job instead of running it (asyncwork.tasks); should it die then too, RabbitMQ moves
            # the message onto dlq.
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
    return (*names, DLQ) if asyncwork_settings.BROKER_IS_RABBITMQ else names


def pressure_queues() -> tuple[str, ...]:
    """The queues whose depth is accepted work not yet done (backpressure, ``/metrics``)."""
    return tuple(name for name, pressure in _queues.items() if pressure)


def queue_for(task_name: str) -> str:
    return _routes.get(task_name, DEFAULT)


# Celery's delayed delivery on RabbitMQ routes a delayed message through its delay exchanges by
# a routing key that is the delay, one bit per level, before the queue's name.
_DELAY_BITS = re.compile(r"^(?:[01]\.){28}")


def queue_delivered(delivery_info: Mapping[str, Any] | None, task_name: str) -> str:
    """The queue a job's message came from, for what sends the job on (retry, dead letter, rescue):
    its routing key less the delay bits Celery's delayed delivery prefixes, or the task's own
    queue where that names none of ours. Taken as it was, the key names a queue nobody reads."""
    key = _DELAY_BITS.sub("", (delivery_info or {}).get("routing_key") or "", count=1)
    if key == DEFAULT or key in _queues or key in _folded:
        return key
    return queue_for(task_name)


def task_route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
    """Celery's router (``task_routes``): a task's queue, from the registry."""
    queue = _routes.get(name)
    return {"queue": queue} if queue else None
