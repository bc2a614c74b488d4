"""``celery_install(app)``: the machinery in a Celery app, in one call. It routes tasks to the
queues the apps declare (``asyncwork.queues``), adds the worker's bootsteps (the heartbeat, the
poll that publishes retries come due, RabbitMQ's dead-letter queue declared before any worker
consumes) and connects the signal receivers (log context across the broker, task metrics, the
heartbeat of each prefork child, the kept database connection, a late soft time limit kept off
the pool). Idempotent: each receiver has a ``dispatch_uid``, a bootstep is added once."""

from __future__ import annotations

from celery import Celery

from asyncwork import db, heartbeat, metrics, queues, timelimits
from asyncwork import logging as log_context
from asyncwork.heartbeat import WorkerHeartbeatStep
from asyncwork.rabbitmq import DeadLetterQueueDeclare
from asyncwork.scheduled import OutboxDuePoll


def celery_install(app: Celery) -> None:
    app.conf.task_default_queue = queues.DEFAULT
    # The queues a worker consumes are known once every app declared its own: the project sets
    # ``app.conf.task_queues = queues.consumed()`` in the ``ready()`` of its last app.
    app.conf.task_routes = (queues.task_route,)
    app.steps["worker"].add(WorkerHeartbeatStep)
    app.steps["worker"].add(OutboxDuePoll)
    app.steps["consumer"].add(DeadLetterQueueDeclare)
    log_context.celery_signals_connect()
    metrics.celery_signals_connect()
    heartbeat.celery_signals_connect()
    db.celery_signals_connect()
    timelimits.celery_signals_connect()
