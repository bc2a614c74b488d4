"""Worker heartbeats, written by real worker processes: one row per pool process (the process
that runs tasks and owns their claims) and one for the worker's own process (the consumer,
which lists the jobs it holds), refreshed on the database's clock, deleted when the worker
stops cleanly."""

from __future__ import annotations

import pytest
from django.db.models.functions import Now

from asyncwork.models import WorkerHeartbeat
from stack import launch
from stack.net import wait_until
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
def test_each_pool_process_beats_and_a_clean_stop_deletes_its_row() -> None:
    env = worker_env(1, {"WORKER_HEARTBEAT_SECONDS": 0.5, "WORKER_HEARTBEAT_LAPSE_SECONDS": 3})
    worker = launch.celery_worker(env, name="beating", concurrency=2)
    try:
        worker.wait_ready()
        assert wait_until(lambda: WorkerHeartbeat.objects.count() == 3, 20, interval=0.1)
        first = {row.owner: row.beat_at for row in WorkerHeartbeat.objects.all()}
        processes = set(worker.pids())  # the worker's own process and its two children
        assert {row.pid for row in WorkerHeartbeat.objects.all()} == processes
        assert all(owner.split(":")[1] in {str(p) for p in processes} for owner in first)
        # Idle: nobody holds a job.
        assert not WorkerHeartbeat.objects.exclude(holding=[]).exists()
        assert wait_until(
            lambda: all(row.beat_at > first[row.owner] for row in WorkerHeartbeat.objects.all()),
            5,
            interval=0.1,
        )
        # Written with the database's clock: never ahead of it.
        assert not WorkerHeartbeat.objects.filter(beat_at__gt=Now()).exists()
    finally:
        worker.stop()
    assert worker.returncode == 0
    assert WorkerHeartbeat.objects.count() == 0
