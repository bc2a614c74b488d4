"""The Celery application: ``celery -A core worker|beat`` need no flags; configuration is
``core.settings``' ``CELERY_`` options."""

import os
from typing import Any

from celery import Celery

from asyncwork import db, heartbeat, metrics, queues, timelimits
from asyncwork import logging as log_context
from asyncwork.heartbeat import WorkerHeartbeatStep
from asyncwork.rabbitmq import DeadLetterQueueDeclare
from asyncwork.scheduled import OutboxDuePoll
from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

app = Celery("core")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _settings_load(**_: Any) -> None:
    """Before the first configuration read (in the CLI, while click parses): settings that do
    not load stop the command with one line, not a traceback through click."""
    settings_load_or_exit()


app.conf.task_default_queue = queues.DEFAULT
# Routes from the registry the apps fill (asyncwork.queues); consumed queues: CoreConfig.ready.
app.conf.task_routes = (queues.task_route,)


app.steps["worker"].add(WorkerHeartbeatStep)
# Publishes the retries and deferrals that have come due (they wait in the outbox).
app.steps["worker"].add(OutboxDuePoll)
# On RabbitMQ, the dead-letter queue exists before any worker consumes.
app.steps["consumer"].add(DeadLetterQueueDeclare)

app.autodiscover_tasks()
log_context.celery_signals_connect()
metrics.celery_signals_connect()
heartbeat.celery_signals_connect()
# A task keeps the process's database connection, as a request does (CELERY_DB_REUSE_MAX).
db.celery_signals_connect()
# A soft time limit fired late must not hit a pool process between jobs.
timelimits.celery_signals_connect()
