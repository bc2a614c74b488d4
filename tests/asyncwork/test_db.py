"""A worker keeps its database connection across tasks, as a web process keeps it across
requests (asyncwork.db, ``CELERY_DB_REUSE_MAX``), and still drops one the server ended: a real
prefork worker against this run's PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from django.core.cache import cache
from django.db import connection

from core.celery import app
from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _backend_pid(timeout: float = 20) -> int:
    """The backend a task of the worker ran on (``tests.backend_pid``)."""
    key = f"pid-{uuid.uuid4().hex}"
    app.send_task(test_tasks.BACKEND_PID, args=[key])
    assert wait_until(lambda: cache.get(key) is not None, timeout=timeout)
    pid = cache.get(key)
    assert isinstance(pid, int)
    return pid


def test_a_worker_runs_its_tasks_on_one_connection_and_replaces_one_the_server_ended() -> None:
    env = worker_env(0)
    worker = launch.celery_worker(env, name="db-reuse", concurrency=1, include=["tests.tasks"])
    with worker:
        first = [_backend_pid() for _ in range(5)]
        # Celery's own rule would open a new connection for each task (five backends).
        assert len(set(first)) == 1, first
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [first[0]])
            assert cursor.fetchone() == (True,)
        # The health check before the next task's first query sees the server's goodbye.
        after = [_backend_pid() for _ in range(3)]
        assert first[0] not in after
        assert len(set(after)) == 1, after


def test_a_task_cut_short_in_a_query_leaves_the_next_task_a_new_connection() -> None:
    """The soft time limit interrupts a task in the middle of its query, whose result the
    server has not sent yet: the socket looks idle, but the connection is busy. The next task
    runs at once, first time, on another backend."""
    env = worker_env(0)
    worker = launch.celery_worker(env, name="db-cut", concurrency=1, include=["tests.tasks"])
    with worker:
        before = _backend_pid()
        cut = app.send_task(test_tasks.BACKEND_PID, args=[f"cut-{uuid.uuid4().hex}", 4]).id
        # Retried (a soft time limit is transient), its retry due minutes later.
        assert wait_until(lambda: f"[{cut}] retry" in worker.log_text(), timeout=20)
        # Before the cut query would have ended (4 s): no retry's wait in between.
        after = _backend_pid(timeout=2.5)
    assert after != before
