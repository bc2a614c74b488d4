"""The jobs a dead worker held are re-enqueued as soon as its heartbeat lapsed
(``asyncwork.heartbeat.held_jobs``, ``asyncwork.rescue.held_jobs_rescue``), not when the broker
gives their messages back: on Redis that is after the visibility timeout (20 s here).

A real prefork worker takes two jobs (running, or received and waiting for its pool), is
SIGKILLed with its whole process group, and another worker runs both within the lapse (3 s)
plus a rescue run. On both brokers: RabbitMQ redelivers at once on the connection's loss, and
the rescue's second copy runs as a no-op for the job (it only counts its runs here)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from django.core.cache import cache

from asyncwork.models import WorkerHeartbeat
from asyncwork.rescue import HELD_JOBS, workers_rescue
from core.celery import app
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LAPSE = 3
NAP_SECONDS = 4


def test_the_jobs_a_killed_worker_held_run_elsewhere_once_its_heartbeat_lapsed(
    settings: Any,
) -> None:
    # The rescue runs in this process.
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": LAPSE}
    keys = [f"nap-{uuid.uuid4().hex}" for _ in range(2)]
    env = worker_env(
        0,
        {**SCALED, "WORKER_HEARTBEAT_SECONDS": 0.5, "WORKER_HEARTBEAT_LAPSE_SECONDS": LAPSE},
        **SCALED_BREAKER,
    )
    doomed = launch.celery_worker(env, name="doomed", include=("tests.tasks",), concurrency=2)
    survivor = None
    try:
        doomed.wait_ready()
        for key in keys:
            app.send_task(test_tasks.NAP, args=[key, NAP_SECONDS])

        def listed() -> list[str]:
            rows = WorkerHeartbeat.objects.filter(pid=doomed.pid).values_list("holding", flat=True)
            return [job["args"][0] for holding in rows for job in holding]

        assert wait_until(lambda: sorted(listed()) == sorted(keys), timeout=15)
        doomed.kill()  # the whole worker, parent included: nothing is left to requeue
        killed = time.monotonic()
        survivor = launch.celery_worker(env, name="survivor", include=("tests.tasks",))
        survivor.wait_ready()
        rescued: dict[str, int] = {}

        def rescue_ran() -> bool:  # as the workers-rescue job does every few seconds
            rescued.update(workers_rescue())
            return rescued.get(HELD_JOBS, 0) > 0

        assert wait_until(rescue_ran, timeout=LAPSE + 10, interval=0.5)
        assert rescued[HELD_JOBS] == 2
        done = wait_until(lambda: all(cache.get(key) for key in keys), timeout=60, interval=0.2)
        seconds = time.monotonic() - killed
        print(f"\nworker SIGKILLed holding 2 jobs: both done {seconds:.1f} s later")
        log = survivor.log_text()
    finally:
        for worker in (doomed, survivor):
            if worker is not None:
                worker.stop()
    assert done
    visibility = int(SCALED["CELERY_VISIBILITY_TIMEOUT"])
    if not broker.RABBITMQ:  # the broker gives the messages back only after this
        assert seconds < visibility, log[-4000:]
    assert seconds < LAPSE + 5 + 2 * NAP_SECONDS
    assert not WorkerHeartbeat.objects.exclude(holding=[]).filter(pid=doomed.pid).exists()
