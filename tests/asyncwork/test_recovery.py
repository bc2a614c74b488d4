"""A broker that lost its queues is recovered by the workers alone, at once: each worker's poll
(``asyncwork.poll``) sees the broker's run id change, or the marker it keeps in the broker gone,
and publishes again every job published and not started (``asyncwork.recovery``); a message that
survived finds its job claimed or done. No beat runs here, nor anything but one worker.

Real processes: a private ``redis-server`` (no persistence) as the broker and a worker. Redis
loses its queues while jobs wait in them: shut down with ``SHUTDOWN NOSAVE`` and started again on
its port (a new run id), or emptied with ``FLUSHALL`` while it runs (the same run id), as a
failover to an empty replica or an operator's mistake leaves it. Redis only: RabbitMQ's quorum
queues keep their messages."""

from __future__ import annotations

import time
import uuid

import pytest
from django.core.cache import cache
from django.utils import timezone

from asyncwork.models import Job
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers.broker import redis_only
from tests.helpers.processes import worker_env
from tests.helpers.redis_server import PrivateRedis

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, redis_only]

JOBS = 20
NAP_SECONDS = 0.3
GOAL_SECONDS = 30  # every job run within 30 s of the broker's loss


def runs(key: str) -> int:
    """How often the nap under ``key`` started (``tests.tasks.nap``)."""
    return int(cache.get(f"{key}:runs") or 0)


@pytest.mark.parametrize("fault", ["restart", "flush"])
def test_the_jobs_a_broker_lost_are_published_again_by_the_worker_and_run_once(
    private_redis: PrivateRedis, fault: str
) -> None:
    keys = [f"nap-{uuid.uuid4().hex}" for _ in range(JOBS)]
    env = worker_env(0, CELERY_BROKER_URL=private_redis.url)
    worker = launch.celery_worker(env, name="recovery", include=("tests.tasks",))
    try:
        worker.wait_ready()
        # Due now: published by the worker's relay, onto the broker the worker reads.
        due = timezone.now()
        ids = [test_tasks.nap.using(run_after=due).enqueue(key, NAP_SECONDS).id for key in keys]
        jobs = Job.objects.filter(pk__in=ids)
        assert wait_until(lambda: not jobs.filter(published_at__isnull=True).exists(), 15)
        assert wait_until(lambda: runs(keys[1]) == 1, 15)  # the worker reads the broker

        if fault == "restart":
            private_redis.shutdown_nosave()
            private_redis.start()
        else:
            private_redis.client().flushall()
        lost = time.monotonic()
        waiting = jobs.filter(status=Job.Status.READY).count()
        done = wait_until(
            lambda: jobs.filter(status=Job.Status.SUCCESSFUL).count() == JOBS,
            GOAL_SECONDS + 30,
            interval=0.2,
        )
        seconds = time.monotonic() - lost
        print(
            f"\nbroker {fault} with {waiting} of {JOBS} jobs waiting in it: every job run "
            f"{seconds:.1f} s later"
        )
        log = worker.log_text()
    finally:
        worker.stop()
    assert waiting > 1, "nearly every job ran before the broker lost them: no test"
    assert done, log[-4000:]
    assert seconds <= GOAL_SECONDS
    # The worker's poll published them again, seeing the broker lose its messages.
    [republished] = [line for line in log.splitlines() if "the broker lost its messages: " in line]
    assert int(republished.split("the broker lost its messages: ")[1].split()[0]) >= waiting - 1
    if fault == "flush":
        assert "the broker lost its data without restarting (its marker is gone)" in log
    # Each ran once: none lost, none twice.
    assert [runs(key) for key in keys] == [1] * JOBS
