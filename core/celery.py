"""The Celery application: ``celery -A core worker`` and ``celery -A core beat`` need no flags.

Configuration lives in ``core.settings`` under the ``CELERY_`` prefix, each non-default option
commented there.
"""

import os
from typing import Any

from celery import Celery

from asyncwork import db, heartbeat, metrics, queues, timelimits
from asyncwork import logging as log_context
from asyncwork.heartbeat import WorkerHeartbeatStep
from asyncwork.rabbitmq import DeadLetterQueueDeclare
from asyncwork.scheduled import OutboxDuePoll
from asyncwork.watchdog import WorkerWatchdog
from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

app = Celery("core")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _settings_load(**_: Any) -> None:
    """Sent before the app first reads its configuration, which in ``celery -A core worker``
    or ``beat`` happens while click parses the options: settings that do not load stop the
    command with one line instead of a traceback through click. In a process that has loaded
    the settings already (the web app, the tests), this does nothing."""
    settings_load_or_exit()


app.conf.task_default_queue = queues.DEFAULT
# Each task's queue is read from the registry the apps fill (asyncwork.queues) when it is sent;
# the queues a worker consumes are set once every app has declared its own (CoreConfig.ready).
app.conf.task_routes = (queues.task_route,)


# A worker idle while its queues hold work exits for its supervisor to restart it.
app.steps["worker"].add(WorkerWatchdog)
# Each process that runs tasks beats, so the claims it holds can be rescued once it is gone.
app.steps["worker"].add(WorkerHeartbeatStep)
# Each worker publishes the retries and deferrals that have come due (they wait in the outbox).
app.steps["worker"].add(OutboxDuePoll)
# On RabbitMQ, the queue the others dead-letter onto exists before any worker consumes.
app.steps["consumer"].add(DeadLetterQueueDeclare)

app.autodiscover_tasks()
# Worker-side observability hangs on Celery's signals: the log context every task line carries
# (and Celery keeping its hands off settings.LOGGING), and the task counters.
log_context.celery_signals_connect()
metrics.celery_signals_connect()
heartbeat.celery_signals_connect()
# A task keeps the process's database connection, as a request does (CELERY_DB_REUSE_MAX).
db.celery_signals_connect()
# A soft time limit fired late (the worker's loop held up) must not hit a pool process between
# jobs, where it corrupts the result it is writing.
timelimits.celery_signals_connect()
