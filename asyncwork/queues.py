"""The Celery queues and the route of every task: one registry, read when a task is published
and when a worker starts.

``default`` always exists. ``dlq`` is RabbitMQ's and nobody consumes it: the consumed queues
dead-letter onto it a message delivered past their delivery limit, one whose worker died on every
delivery, so that no dead-letter row was written for it; it waits there for an operator (a job that
failed otherwise is a ``DeadLetter`` row, ``asyncwork.deadletters``). Any other queue is declared by
the app that owns it, once, beside its tasks' names (``queue_declare``, with the tasks routed to
it), so a task's queue is decided in one place. A queue declared with ``pressure=True`` is one whose
depth means work accepted and not yet done: backpressure sheds on it, and ``/metrics`` reports it.

Order. A worker consumes ``default`` first, then the declared queues in the order they were
declared, each queue declared ``ahead_of`` another just before that one: on Redis strictly
(``queue_order_strategy: priority``: one ``BRPOP`` over the queues in that order, so a queue is read
only when those before it are empty). An app that enqueues some work again (a rescue, a reconcile)
declares a queue for it ahead of its main queue (``ahead_of``), so the oldest work does not wait
behind everything queued since; on RabbitMQ, which cannot order a consumer's queues, such a queue is
folded into the one it was to go ahead of. ``default`` holds the scheduled jobs, few and short,
which must not wait behind a backlog either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings
from kombu import Exchange, Queue

DEFAULT = "default"
DLQ = "dlq"

_queues: dict[str, bool] = {}  # name -> counts toward backpressure
_routes: dict[str, str] = {}  # task name -> queue
_folded: dict[str, str] = {}  # a queue this broker cannot read first -> the queue used instead
_ahead: dict[str, str] = {}  # a queue -> the queue read ahead of it (its recovered work)


def queue_declare(
    name: str, *, pressure: bool = False, ahead_of: str | None = None, tasks: Iterable[str] = ()
) -> str:
    """Declare the queue ``name``, to which ``tasks`` (task names) are published, and which
    ``celery -A core worker`` consumes when started without ``-Q``, after ``default`` and the
    queues declared before it. Returns ``name``.

    ``ahead_of``: a queue declared before; this one exists only to be read before it. On RabbitMQ,
    which cannot order a consumer's queues, it is not declared, and what is sent to it goes to
    ``ahead_of`` (``queue_resolve``): there a second queue would only give every worker a second
    prefetch window (quorum queues count prefetch per consumer), in which a paused worker swallows
    the very messages meant to rescue it."""
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
    if settings.BROKER_IS_RABBITMQ:
        _folded[name] = ahead_of
        return name
    declared = list(_queues.items())
    at = [queue for queue, _ in declared].index(ahead_of)
    _queues.clear()
    _queues.update([*declared[:at], (name, pressure), *declared[at:]])
    return name


def queue_resolve(name: str) -> str:
    """The queue a message for ``name`` goes to on this broker (``queue_declare``)."""
    return _folded.get(name, name)


def queue_ahead(name: str) -> str:
    """Where recovered work of queue ``name`` goes: the queue registered ahead of it, if any
    (as this broker resolves it), else ``name`` itself."""
    return queue_resolve(_ahead.get(name, name))


def consumed() -> tuple[Queue, ...]:
    """What a worker started with no ``-Q`` consumes: ``default`` and every declared queue."""
    return tuple(_declaration(name) for name in (DEFAULT, *_queues))


def _declaration(name: str) -> Queue:
    """A consumed queue as the broker declares it. On Redis, a plain list. On RabbitMQ, a
    durable quorum queue with a delivery limit past which RabbitMQ dead-letters a message onto
    ``dlq`` (``dlq_declaration``), bound to a topic exchange of its own: Celery's native delayed
    delivery routes a delayed message back through it (it cannot through a direct one)."""
    if not settings.BROKER_IS_RABBITMQ:
        return Queue(name)
    return Queue(
        name,
        Exchange(name, type="topic"),
        routing_key=name,
        durable=True,
        queue_arguments={
            "x-queue-type": "quorum",
            # RabbitMQ delivers a message this many times plus one. A worker dead-letters the
            # job, with its reason, on that last delivery instead of running it
            # (``asyncwork.tasks``); should the worker die on that one too, RabbitMQ moves
            # the message onto dlq.
            "x-delivery-limit": settings.BROKER_DELIVERY_LIMIT - 1,
            "x-dead-letter-exchange": DLQ,
            "x-dead-letter-routing-key": DLQ,
        },
    )


def dlq_declaration() -> Queue:
    """``dlq`` as RabbitMQ holds it: a quorum queue behind a direct exchange of the same name,
    which is where the consumed queues dead-letter to. Declared by each worker as it starts
    (``asyncwork.rabbitmq``), so that a message RabbitMQ dead-letters is never dropped."""
    return Queue(
        DLQ,
        Exchange(DLQ, type="direct"),
        routing_key=DLQ,
        queue_arguments={"x-queue-type": "quorum"},
    )


def watched() -> tuple[str, ...]:
    """The queues whose depth an operator reads (the probes, ``pipeline_status``, the
    dashboard): those the workers consume and, on RabbitMQ, ``dlq``."""
    names = tuple(queue.name for queue in consumed())
    return (*names, DLQ) if settings.BROKER_IS_RABBITMQ else names


def pressure_queues() -> tuple[str, ...]:
    """The queues whose depth is accepted work not yet done (backpressure, ``/metrics``)."""
    return tuple(name for name, pressure in _queues.items() if pressure)


def queue_for(task_name: str) -> str:
    return _routes.get(task_name, DEFAULT)


# Celery's delayed delivery on RabbitMQ routes a delayed message through its delay exchanges by
# a routing key that is the delay, one bit per level, before the queue's name.
_DELAY_BITS = re.compile(r"^(?:[01]\.){28}")


def queue_delivered(delivery_info: Mapping[str, Any] | None, task_name: str) -> str:
    """The queue a job's message came from, for what sends the job on again (its retry, its
    dead letter, its rescue): the message's routing key, less the delay's bits of a message
    that came through Celery's delayed delivery; the task's own queue where that names no
    queue of ours. Taken as it was, such a key named a queue nobody reads: the retry published
    to it was accepted (and confirmed) by RabbitMQ, and never ran."""
    key = _DELAY_BITS.sub("", (delivery_info or {}).get("routing_key") or "", count=1)
    if key == DEFAULT or key in _queues or key in _folded:
        return key
    return queue_for(task_name)


def task_route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
    """Celery's router (``task_routes``): a task's queue, read from the registry when it is
    published."""
    queue = _routes.get(name)
    return {"queue": queue} if queue else None
