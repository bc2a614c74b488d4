"""``asyncwork.install(app)``: the machinery in a Celery app, in one call, beside
``TASKS = {"default": {"BACKEND": "asyncwork.backend.OutboxBackend"}}``.

It adds the worker's bootsteps (the heartbeat, the poll that relays, publishes what came due and
rescues dead workers' jobs, RabbitMQ's dead-letter queue declared before any worker consumes),
connects the signal receivers that read no model (log context across the broker, the
kept database connection, a message for no task kept as a dead letter), and, once Celery reads its
configuration, sets what the guarantees need where the project left Celery's default
(``REQUIRED``; ``manage.py check`` names a project value that weakens one, ``asyncwork.checks``).
Celery's logging is left as Celery sets it. Idempotent: each receiver has a ``dispatch_uid``, a
bootstep is added once. The task that runs jobs and the receivers of each pool process (its
heartbeat, its soft time limit) are the runner's, which loads with Django's apps
(``asyncwork.runner``, ``AsyncWorkConfig.ready()``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import task_unknown
from django.db import connection

from asyncwork import broker, db
from asyncwork import logging as log_context
from asyncwork.broker import DeadLetterQueueDeclare
from asyncwork.poll import PollStep

# The heartbeat of the worker's own process, by name: Celery imports it as the worker starts,
# Django's apps loaded, and its module reads the models, which load after this one.
HEARTBEAT_STEP = "asyncwork.runner:WorkerHeartbeatStep"

# Celery settings the guarantees rely on, set unless the project set its own.
REQUIRED: dict[str, Any] = {
    # At-least-once, for the job runner and the periodic jobs alike: acknowledged after the
    # task ran, and requeued if its process was killed.
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    # A worker reserves one message at a time: a dying worker strands at most one.
    "worker_prefetch_multiplier": 1,
    # A budget for every run: past the soft limit a job's run is retried as transient, past the
    # hard one its process is killed (a task's own time_limit overrides both).
    "task_soft_time_limit": 300,
    "task_time_limit": 315,
    "task_default_queue": broker.DEFAULT,
}
# On Redis: kombu's transport with an acknowledgement that never loses its slot, and each queue
# read after the one ahead of it (asyncwork.broker).
REDIS_TRANSPORT = "asyncwork.broker:Transport"
REDIS_TRANSPORT_OPTIONS: dict[str, Any] = {
    "queue_order_strategy": "priority",
    # A job's redelivery after this is harmless (its claim), so it needs only to outlive most
    # runs; a dead worker's jobs are rescued by heartbeat long before.
    "visibility_timeout": 3600,
}
# On RabbitMQ: a job is marked published once the broker confirmed it.
RABBITMQ_TRANSPORT_OPTIONS: dict[str, Any] = {"confirm_publish": True}


def install(app: Celery) -> None:
    app.on_after_configure.connect(_configure, weak=False, dispatch_uid="asyncwork.install")
    app.steps["worker"].add(HEARTBEAT_STEP)
    app.steps["worker"].add(PollStep)
    app.steps["consumer"].add(DeadLetterQueueDeclare)
    task_unknown.connect(_unknown, weak=False, dispatch_uid="asyncwork.install.unknown")
    log_context.celery_signals_connect()
    db.celery_signals_connect()


def _configure(sender: Celery, **_: Any) -> None:
    """Once Celery has read its configuration: each setting the guarantees need, where the project
    gave none (in its configuration source, or on the app). A value it gave is kept, Celery's
    default included (``task_acks_late = False``): the system checks name one that weakens a
    guarantee (``asyncwork.checks``), and would otherwise warn of a value not in force."""
    conf = sender.conf
    for key, value in {**REQUIRED, "task_queues": broker.consumed()}.items():
        if not conf.value_set_for(key):
            conf[key] = value
    url = str(conf.broker_url or "")
    options = dict(conf.broker_transport_options or {})
    if url.startswith("redis://"):  # rediss:// keeps kombu's own: its TLS set-up keys on it
        if not conf.value_set_for("broker_transport"):
            conf.broker_transport = REDIS_TRANSPORT
        conf.broker_transport_options = {**REDIS_TRANSPORT_OPTIONS, **options}
    elif broker.rabbitmq():
        conf.broker_transport_options = {**RABBITMQ_TRANSPORT_OPTIONS, **options}


class UnknownTask(LookupError):
    """A message for a Celery task this worker does not have."""


def _unknown(name: str = "", id: str = "", message: Any = None, **_: Any) -> None:
    """``task_unknown``: Celery logs such a message and drops it; it is also a dead letter here,
    so nothing vanishes (a typo, a task renamed while its messages waited, a worker of an older
    release)."""
    try:
        args, kwargs, _embed = message.decode()
    except Exception:  # noqa: BLE001 - a body it cannot read: the letter still says which task
        args, kwargs = [], {}
    try:
        _unknown_record(name, id, message, args, kwargs)
    finally:
        connection.close()  # on the consumer's thread, which keeps no connection of its own


def _unknown_record(name: str, id: str, message: Any, args: Any, kwargs: Any) -> None:
    from asyncwork.deadletters import record  # the models load with Django's apps
    from asyncwork.models import DeadLetter

    record(
        task=name[:200],
        task_id=id or f"unknown-{message.delivery_tag}",
        args=list(args) if isinstance(args, list | tuple) else [],
        kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
        queue=str((message.delivery_info or {}).get("routing_key") or ""),
        reason=DeadLetter.Reason.PERMANENT,
        exc=UnknownTask(f"no Celery task {name!r} in this worker: it received it and dropped it"),
        traceback="",
        attempts=0,
    )
