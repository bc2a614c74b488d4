"""``asyncwork.install.celery_install``: a Celery app of a project's own gets the machinery in
one call, as this project's does (core/celery.py). A fresh app, installed twice, runs a real
worker that beats (its row while it runs, none after) and publishes a retry come due."""

from __future__ import annotations

import os

import pytest
from asyncwork.scheduled import OutboxDuePoll
from celery import Celery
from django.utils import timezone

from asyncwork import queues
from asyncwork.heartbeat import WorkerHeartbeatStep
from asyncwork.install import celery_install
from asyncwork.models import OutboxMessage, WorkerHeartbeat
from asyncwork.queues import DeadLetterQueueDeclare
from stack import launch
from stack.net import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_fresh_celery_app_gets_the_machinery_in_one_call() -> None:
    fresh = Celery("fresh", set_as_current=False)
    fresh.config_from_object("django.conf:settings", namespace="CELERY")
    celery_install(fresh)
    celery_install(fresh)  # once is enough; twice changes nothing
    fresh.conf.task_queues = queues.consumed()

    assert fresh.conf.task_default_queue == queues.DEFAULT
    assert {WorkerHeartbeatStep, OutboxDuePoll} <= fresh.steps["worker"]
    assert fresh.steps["consumer"] == {DeadLetterQueueDeclare}
    due = OutboxMessage.objects.create(task="core.nothing", queue="default", due_at=timezone.now())
    beating = WorkerHeartbeat.objects.filter(pid=os.getpid())
    with launch.worker_thread(fresh, concurrency=1):
        assert wait_until(beating.exists, timeout=10)
        assert wait_until(
            lambda: OutboxMessage.objects.filter(pk=due.pk, published_at__isnull=False).exists(),
            timeout=10,
        )
    assert not beating.exists()
