"""A soft time limit reaches only the task it was set for (``asyncwork.runner``).

A prefork worker whose event loop was held up (reconnecting to a restarted broker) fires a soft
time limit late, for a job already finished: ``SIGUSR1`` lands in a pool process that is
writing that job's result or waiting for its next job. Here a real worker's pool process gets
that signal while idle: it ignores it, says so, and runs the next task itself; a task that
does overrun its soft limit is still interrupted.
"""

from __future__ import annotations

import os
import signal

import pytest
from django.core.cache import cache

from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.processes import worker_env
from tests.tasks import overrun, pid

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_late_soft_time_limit_signal_spares_an_idle_pool_process(smtp: SmtpServer) -> None:
    env = worker_env(smtp.port)
    worker = launch.celery_worker(env, name="limits", include=("tests.tasks",), concurrency=1)
    keys = [f"timelimits-{os.getpid()}-{name}" for name in ("first", "second", "overrun")]
    cache.delete_many(keys)
    try:
        worker.wait_ready()
        pid.enqueue(keys[0])
        first = wait_until(lambda: cache.get(keys[0]), 20, interval=0.1)
        assert first, worker.log_text()[-3000:]
        os.kill(first, signal.SIGUSR1)  # what a soft time limit fired after its job ended sends
        pid.enqueue(keys[1])
        second = wait_until(lambda: cache.get(keys[1]), 20, interval=0.1)
        overrun.enqueue(keys[2])
        overran = wait_until(lambda: cache.get(keys[2]), 20, interval=0.1)
        log = worker.log_text()
    finally:
        worker.stop()
        cache.delete_many(keys)
    assert "soft time limit signal ignored" in log, log[-3000:]
    assert second == first, f"the pool process was replaced:\n{log[-3000:]}"
    assert "exited with" not in log
    assert "Unrecoverable error" not in log
    assert overran == "interrupted"
