"""``asyncwork.install(app)``: a Celery app of a project's own gets the machinery in one call, as
this project's does (core/celery.py). A fresh app, installed twice, runs a real worker that
beats (its row while it runs, none after) and whose poll publishes a job come due, which it
runs. What the guarantees need is set only where the project left Celery's default, and
Celery's logging is left as Celery sets it (a library that connected ``setup_logging`` would
turn it off; this project connects its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from celery import Celery
from django.core.cache import cache
from django.utils import timezone
from kombu import Queue

import asyncwork
from asyncwork import broker
from asyncwork.broker import DeadLetterQueueDeclare
from asyncwork.install import HEARTBEAT_STEP, REDIS_TRANSPORT, REQUIRED
from asyncwork.models import Job, WorkerHeartbeat
from asyncwork.poll import PollStep
from core.celery import app as project_app
from stack import launch
from stack.net import wait_until
from stack.process import ROOT
from tests import tasks as test_tasks


def fresh_app() -> Celery:
    """A Celery app configured from Django's settings, as a project's own would be."""
    fresh = Celery("fresh", set_as_current=False)
    fresh.config_from_object("django.conf:settings", namespace="CELERY")
    return fresh


@pytest.mark.django_db(transaction=True)
def test_a_fresh_celery_app_gets_the_machinery_in_one_call() -> None:
    fresh = fresh_app()
    asyncwork.install(fresh)
    asyncwork.install(fresh)  # once is enough; twice changes nothing

    assert fresh.conf.task_default_queue == broker.DEFAULT
    assert [queue.name for queue in fresh.conf.task_queues] == [
        queue.name for queue in broker.consumed()
    ]
    assert {HEARTBEAT_STEP, PollStep} <= fresh.steps["worker"]
    assert fresh.steps["consumer"] == {DeadLetterQueueDeclare}
    key = f"installed-{os.getpid()}"
    # Due now and never published: nothing but the worker's poll publishes it.
    due = Job.objects.create(
        task=test_tasks.pid.module_path, kwargs={"key": key}, queue="default", due_at=timezone.now()
    )
    beating = WorkerHeartbeat.objects.filter(pid=os.getpid())
    try:
        with launch.worker_thread(fresh, concurrency=1):
            assert wait_until(beating.exists, timeout=10)
            assert wait_until(
                lambda: Job.objects.filter(pk=due.pk, status=Job.Status.SUCCESSFUL).exists(),
                timeout=15,
            )
    finally:
        # Celery's test worker made the fresh app this process's current one: the next tests
        # publish through the project's.
        project_app.set_current()
        project_app.set_default()
    assert not beating.exists()
    job = Job.objects.get(pk=due.pk)
    assert job.published_at is not None
    assert (job.attempts, cache.get(key)) == (1, os.getpid())  # run by this process's worker


def delete_setting(settings: Any, name: str) -> None:
    if hasattr(settings, name):
        delattr(settings, name)


def test_where_the_project_left_celerys_default_install_sets_what_the_guarantees_need(
    settings: Any,
) -> None:
    for key in REQUIRED:
        delete_setting(settings, f"CELERY_{key.upper()}")
    delete_setting(settings, "CELERY_TASK_QUEUES")
    delete_setting(settings, "CELERY_BROKER_TRANSPORT")
    fresh = fresh_app()
    asyncwork.install(fresh)

    assert {key: fresh.conf[key] for key in REQUIRED} == REQUIRED
    assert [queue.name for queue in fresh.conf.task_queues] == [
        queue.name for queue in broker.consumed()
    ]
    if broker.rabbitmq():
        assert fresh.conf.broker_transport_options["confirm_publish"] is True
    else:
        assert fresh.conf.broker_transport == REDIS_TRANSPORT
        assert fresh.conf.broker_transport_options["queue_order_strategy"] == "priority"


# A value of the project's own for each setting install would otherwise set: none of them
# Celery's default, nor what install sets.
PROJECTS_OWN: dict[str, Any] = {
    "task_acks_late": False,
    "task_reject_on_worker_lost": False,
    "worker_prefetch_multiplier": 4,
    "task_soft_time_limit": 100,
    "task_time_limit": 120,
    "task_default_queue": "projects-own",
}


def test_a_setting_the_project_gave_is_kept_even_where_it_weakens_a_guarantee(
    settings: Any,
) -> None:
    assert set(PROJECTS_OWN) == set(REQUIRED)
    for key, value in PROJECTS_OWN.items():
        assert value != REQUIRED[key]
        setattr(settings, f"CELERY_{key.upper()}", value)
    own_queues = (Queue("projects-own"),)
    settings.CELERY_TASK_QUEUES = own_queues
    settings.CELERY_BROKER_TRANSPORT = "redis"
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        **settings.CELERY_BROKER_TRANSPORT_OPTIONS,
        "queue_order_strategy": "round_robin",
        "confirm_publish": False,
    }
    fresh = fresh_app()
    asyncwork.install(fresh)

    assert {key: fresh.conf[key] for key in REQUIRED} == PROJECTS_OWN
    assert fresh.conf.task_queues == own_queues
    assert fresh.conf.broker_transport == "redis"
    options = fresh.conf.broker_transport_options
    assert (options["queue_order_strategy"], options["confirm_publish"]) == ("round_robin", False)


# A process that loads every module of the package and installs the machinery in a fresh app of
# a project that has every part of it installed (no core.celery, whose own receiver would hide
# one of the package's), then has Celery set up its logging as a worker does, and logs one line.
_LOGGING_SCRIPT = """
import logging

import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.contenttypes",
        "django.contrib.auth",
        "django.contrib.messages",
        "django.contrib.sessions",
        "django_celery_beat",
        "asyncwork",
        "asyncwork.contrib.periodic",
        "asyncwork.contrib.monitoring",
        "asyncwork.contrib.admin",
        "rest_framework",
        "knox",
        "asyncwork.contrib.operators",
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "unused"}},
    USE_TZ=True,
    CELERY_BROKER_URL="redis://127.0.0.1:6379/15",
    TASKS={"default": {"BACKEND": "asyncwork.backend.OutboxBackend"}},
)
django.setup()

import importlib
import pkgutil

from celery import Celery, signals

import asyncwork

# Every module of the package, contrib included: none may connect a receiver as it loads.
for module in pkgutil.walk_packages(asyncwork.__path__, "asyncwork."):
    importlib.import_module(module.name)

app = Celery("fresh", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
asyncwork.install(app)
print("receivers", len(signals.setup_logging.receivers), flush=True)
app.log.setup(loglevel="INFO")
logging.getLogger("celery.worker").info("the line Celery formats")
"""


def test_install_leaves_celerys_logging_as_celery_sets_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOGGING_SCRIPT)],
        cwd=ROOT,
        env={key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "receivers 0" in done.stdout
    # Celery's own format: it configured the logging itself.
    assert "INFO/MainProcess] the line Celery formats" in done.stderr


def test_this_projects_celery_app_logs_as_django_does() -> None:
    """core/celery.py connects ``setup_logging`` itself: a worker's lines take Django's
    ``LOGGING`` (the format the web's lines have), not Celery's."""
    script = (
        "import logging, django; from core.celery import app; django.setup(); "
        "app.log.setup(loglevel='INFO'); "
        "logging.getLogger('celery.worker').info('the line Django formats')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "LOG_FORMAT": "json"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "the line Django formats" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("{")
    assert "/MainProcess]" not in lines[0]
