"""The jobs a dead worker held run elsewhere as soon as its heartbeat lapsed, by the workers' own
poll (``asyncwork.poll``, its rescue ``asyncwork.rescue.jobs_rescue``), not when the broker gives
their messages back: on Redis that is after the visibility timeout (20 s here).

A real prefork worker holds two jobs: one running in a pool process, and one it received while
its other pool process could not start it (stopped, as a busy pool leaves a received job), so
the job is still READY and its worker's heartbeat lists it (``asyncwork.runner.held_jobs``:
job ids). The worker is SIGKILLed with its whole process group; another worker, and nothing
else, runs both within the lapse (3 s) plus a rescue run: the running one as its owner's
heartbeat lapsed, the waiting one as its consumer's did. On both brokers: RabbitMQ redelivers
at once on the connection's loss, and a message that finds its job claimed or done does
nothing (``asyncwork.runner``)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from django.core.cache import cache

from asyncwork.models import Job, WorkerHeartbeat
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import SCALED, SCALED_BREAKER, worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LAPSE = 3
NAP_SECONDS = 4


def runs(key: str) -> int:
    """How often the nap under ``key`` started (``tests.tasks.nap``)."""
    return int(cache.get(f"{key}:runs") or 0)


def test_the_jobs_a_killed_worker_held_run_elsewhere_once_its_heartbeat_lapsed() -> None:
    running_key, waiting_key = (f"nap-{uuid.uuid4().hex}" for _ in range(2))
    env = worker_env(
        0,
        {**SCALED, "WORKER_HEARTBEAT_SECONDS": 0.5, "WORKER_HEARTBEAT_LAPSE_SECONDS": LAPSE},
        **SCALED_BREAKER,
    )
    doomed = launch.celery_worker(env, name="doomed", include=("tests.tasks",), concurrency=2)
    survivor = None
    try:
        doomed.wait_ready()
        running = Job.objects.get(pk=test_tasks.nap.enqueue(running_key, NAP_SECONDS).id)
        assert wait_until(lambda: runs(running_key) == 1, timeout=15)
        running.refresh_from_db()
        # The other pool process cannot start what it is given: the next job waits, received.
        runner = int(running.owner.split(":")[1])
        [idle] = [pid for pid in doomed.pids() if pid not in (doomed.pid, runner)]
        os.kill(idle, signal.SIGSTOP)
        waiting = Job.objects.get(pk=test_tasks.nap.enqueue(waiting_key, NAP_SECONDS).id)

        def holding() -> list[int]:
            row = WorkerHeartbeat.objects.filter(pid=doomed.pid).first()
            return sorted(row.holding) if row is not None else []

        assert wait_until(lambda: holding() == sorted([running.pk, waiting.pk]), timeout=15)
        waiting.refresh_from_db()
        assert (waiting.status, waiting.attempts) == ("READY", 0)
        assert waiting.published_at is not None
        doomed.kill()  # the whole worker, parent included: nothing is left to requeue
        killed = time.monotonic()
        survivor = launch.celery_worker(
            env, name="survivor", include=("tests.tasks",), concurrency=2
        )
        survivor.wait_ready()
        done = wait_until(
            lambda: cache.get(running_key) and cache.get(waiting_key), timeout=60, interval=0.2
        )
        seconds = time.monotonic() - killed
        print(f"\nworker SIGKILLed holding 2 jobs: both done {seconds:.1f} s later")
        # The rescue also empties the dead consumer's list, once its heartbeat lapsed.
        emptied = wait_until(lambda: holding() == [], timeout=LAPSE + 5)
        log = survivor.log_text()
    finally:
        for worker in (doomed, survivor):
            if worker is not None:
                worker.stop()
    assert done, log[-4000:]
    assert emptied, log[-6000:]
    visibility = int(SCALED["TEST_VISIBILITY_TIMEOUT"])
    if not broker.RABBITMQ:  # the broker gives the messages back only after this
        assert seconds < visibility, log[-4000:]
        # The survivor's poll, not the broker, gave both back.
        rescued = [line for line in log.splitlines() if "rescue jobs: " in line]
        assert sum(int(line.split("rescue jobs: ")[1].split()[0]) for line in rescued) == 2, log
    assert seconds < LAPSE + 5 + 2 * NAP_SECONDS, log[-6000:]
    # The running one started again once (its first run was killed), the waiting one once.
    assert (runs(running_key), runs(waiting_key)) == (2, 1)
    for job in (running, waiting):
        job.refresh_from_db()
        assert job.status == "SUCCESSFUL"
