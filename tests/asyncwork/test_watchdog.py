"""A worker that stays alive and consumes nothing while its queue holds work exits, for its
supervisor to restart it (``asyncwork.watchdog``), and the work is done by the next worker.

The stuck consumer is real: the worker is told to stop consuming its queue (Celery's remote
``cancel_consumer``), which leaves it alive, connected and idle, as a worker whose event loop
died is. On both brokers (``BOTH_BROKERS``): on Redis the watchdog reads the queue's lists, on
RabbitMQ the messages ready by a passive declaration.
"""

from __future__ import annotations

import socket
import time

import pytest

from asyncwork import queues
from asyncwork.watchdog import EXIT_CODE
from core.celery import app
from stack import launch
from stack.net import free_port, wait_until
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WATCHDOG_SECONDS = 4


def test_a_worker_idle_with_work_waiting_exits_and_the_next_does_the_work() -> None:
    env = worker_env(free_port(), {"WORKER_WATCHDOG_SECONDS": WATCHDOG_SECONDS})
    stuck = launch.celery_worker(env, name="stuck", include=("tests.tasks",), concurrency=1)
    fresh = None
    try:
        stuck.wait_ready()
        replies = app.control.cancel_consumer(
            queues.DEFAULT, destination=[f"stuck@{socket.gethostname()}"], reply=True, timeout=5
        )
        assert replies, "the worker did not answer cancel_consumer"
        for n in range(3):
            app.send_task(test_tasks.DIVIDE, args=[n, 1])
        waiting = time.monotonic()
        assert wait_until(lambda: not stuck.alive(), timeout=WATCHDOG_SECONDS + 10)
        seconds = time.monotonic() - waiting
        print(f"\nstuck worker exited {seconds:.1f} s after work began waiting")
        assert stuck.returncode == EXIT_CODE
        assert broker.queue_depth(queues.DEFAULT) == 3  # nothing lost

        fresh = launch.celery_worker(env, name="fresh", include=("tests.tasks",))
        fresh.wait_ready()
        assert wait_until(lambda: fresh.log_text().count(" succeeded in ") == 3, timeout=30)
    finally:
        stuck.stop()
        if fresh is not None:
            fresh.stop()
    log = stuck.log_text()
    assert "worker watchdog: a free slot while 3 message(s) waited in" in log, log[-3000:]
    assert seconds <= WATCHDOG_SECONDS + 3
