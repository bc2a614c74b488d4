"""A worker keeps its database connection across tasks, as a web process keeps it across
requests (asyncwork.db, ``CELERY_DB_REUSE_MAX``), and still drops one the server ended: a real
prefork worker against this run's PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from django.core.cache import cache
from django.db import connection
from django_tasks import TaskResult

from stack import launch
from stack.net import wait_until
from tests import tasks as test_tasks
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _backend_pid(timeout: float = 20) -> int:
    """The backend a task of the worker ran on (``tests.backend_pid``)."""
    key = f"pid-{uuid.uuid4().hex}"
    test_tasks.backend_pid.enqueue(key)
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


# Seconds the cut task's query would take: its soft time limit (1 s) interrupts it.
CUT_QUERY_SECONDS = 4


def test_a_task_cut_short_in_a_query_leaves_the_next_task_a_new_connection() -> None:
    """The soft time limit interrupts a task in the middle of its query, whose result the
    server has not sent yet: the socket looks idle, but the connection is busy. The next task
    runs on another backend, first time, before the cut query would have ended."""
    env = worker_env(0)
    worker = launch.celery_worker(env, name="db-cut", concurrency=1, include=["tests.tasks"])
    with worker:
        before = _backend_pid()
        cut = test_tasks.backend_pid.enqueue(f"cut-{uuid.uuid4().hex}", CUT_QUERY_SECONDS)
        assert wait_until(lambda: _status(cut) == "RUNNING", timeout=20)
        # Waiting on the broker while the cut task runs: the worker's next task.
        key = f"pid-{uuid.uuid4().hex}"
        following = test_tasks.backend_pid.enqueue(key)
        assert wait_until(lambda: cache.get(key) is not None, timeout=20), worker.log_text()
        after = cache.get(key)
    cut.refresh()
    following.refresh()
    # Cut, and retried: a soft time limit is transient.
    assert cut.errors[0].exception_class_path.endswith(".SoftTimeLimitExceeded")
    assert (following.status, following.attempts) == ("SUCCESSFUL", 1)
    assert after != before
    # A connection that waited for the cut query's end would have started it no sooner.
    assert following.started_at is not None
    assert cut.started_at is not None
    waited = (following.started_at - cut.started_at).total_seconds()
    print(f"\nthe next task started {waited:.1f} s after the cut one")
    assert waited < CUT_QUERY_SECONDS


def _status(result: TaskResult[None]) -> str:
    result.refresh()
    return str(result.status)
