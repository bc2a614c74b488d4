"""The Celery queues and the route of every task: one registry, read when a task is published
and when a worker starts.

``default`` always exists and ``dlq`` is never consumed: nothing reads it unless an operator
asks, so its depth in the broker is the number of dead letters waiting for a human. Any other
queue is declared by the app that owns it (``queue_register`` from its ``AppConfig.ready()``),
with the tasks routed to it (``route_register``), so a task's queue is decided in one place,
beside the task. A queue declared with ``pressure=True`` is one whose depth means work
accepted and not yet done: backpressure sheds on it, and ``/metrics`` reports it.
"""

from __future__ import annotations

from typing import Any

from kombu import Queue

DEFAULT = "default"
DLQ = "dlq"

_queues: dict[str, bool] = {}  # name -> counts toward backpressure
_routes: dict[str, str] = {}  # task name -> queue


def queue_register(name: str, *, pressure: bool = False) -> None:
    """Declare a queue that ``celery -A core worker`` consumes when started without ``-Q``."""
    if name in (DEFAULT, DLQ):
        raise ValueError(f"queue {name!r} is the machinery's own")
    _queues[name] = pressure


def route_register(task: str, queue: str) -> None:
    """Publish ``task`` to ``queue`` (a queue declared with ``queue_register``)."""
    if queue not in _queues:
        raise ValueError(f"queue {queue!r} is not declared")
    _routes[task] = queue


def consumed() -> tuple[Queue, ...]:
    """What a worker started with no ``-Q`` consumes: ``default`` and every declared queue."""
    return (Queue(DEFAULT), *(Queue(name) for name in _queues))


def pressure_queues() -> tuple[str, ...]:
    """The queues whose depth is accepted work not yet done (backpressure, ``/metrics``)."""
    return tuple(name for name, pressure in _queues.items() if pressure)


def queue_for(task_name: str) -> str:
    return _routes.get(task_name, DEFAULT)


def task_route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
    """Celery's router (``task_routes``): a task's queue, read from the registry when it is
    published."""
    queue = _routes.get(name)
    return {"queue": queue} if queue else None
