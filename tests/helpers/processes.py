"""The project's processes as the tests run them: on this test run's database, broker and
cache (``tests/settings.py``), started through the kit (``stack.launch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta

from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from asyncwork.models import DeadLetter, Job, WorkerHeartbeat
from asyncwork.runner import Heartbeat
from core.celery import app
from stack import launch
from stack.net import HOST, wait_until
from stack.process import ROOT

# Worker timing scaled down for the tests that wait on a redelivery (visibility 20 s instead
# of 180 s, lease 10 s), keeping every relation core.settings checks.
SCALED: dict[str, int] = {
    "TEST_VISIBILITY_TIMEOUT": 20,
    "CELERY_TASK_TIME_LIMIT": 15,
    "CELERY_TASK_SOFT_TIME_LIMIT": 12,
    "EMAIL_TASK_TIME_LIMIT": 8,
    "EMAIL_TASK_SOFT_TIME_LIMIT": 6,
    "EMAIL_CLAIM_LEASE_SECONDS": 10,
}
# A deferral waits 5 to 10 s (an operator setting: read from the environment).
SCALED_BREAKER = {"EMAIL_BREAKER_RESET_SECONDS": "5"}


def asyncwork_changed(**changes: object) -> dict[str, object]:
    """Settings for ``worker_env(settings=...)``: this run's ``ASYNCWORK`` with ``changes``
    (``WORKER_HEARTBEAT_LAPSE_SECONDS=3``...). The machinery reads its settings from that one dict,
    which a process's settings replace whole: its other keys must come along."""
    return {"ASYNCWORK": {**django_settings.ASYNCWORK, **changes}}


def worker_env(
    smtp_port: int, settings: Mapping[str, object] | None = None, **extra: str
) -> dict[str, str]:
    """The environment of a process that shares this test's database and broker (a worker,
    beat, gunicorn, manage.py), sending email to ``HOST``:``smtp_port``; ``settings``: Django
    settings of its own (tests/settings.py), ``extra``: environment variables."""
    db = connection.settings_dict
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "EMAIL_HOST": HOST,
        "EMAIL_PORT": str(smtp_port),
        "TEST_SETTINGS": json.dumps(dict(settings or {})),
        **extra,
    }


def python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A real ``python <args>`` from the repository's root on this test's database and settings
    (``manage.py ...``, ``-m stack.stripe_trigger ...``): what an operator's shell runs."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=worker_env(0),
    )


def worker_thread(concurrency: int = 2) -> AbstractContextManager[None]:
    """A real worker of the project's Celery app in this process, on threads, for a block
    (``stack.launch.worker_thread``)."""
    return launch.worker_thread(app, concurrency=concurrency)


@contextmanager
def a_lapsed_and_a_live_worker() -> Iterator[Heartbeat]:
    """A worker process killed two minutes ago (its heartbeat row never deleted, on host
    "gone-host") and one beating now (a real heartbeat thread, on its own connection), for the
    block; the live one stops cleanly at its end, deleting its row."""
    WorkerHeartbeat.objects.create(
        owner="gone-host:41:dead",
        hostname="gone-host",
        pid=41,
        started_at=timezone.now() - timedelta(minutes=5),
        beat_at=timezone.now() - timedelta(minutes=2),
    )
    beating = Heartbeat(interval=0.2)
    beating.start()
    try:
        assert wait_until(
            lambda: WorkerHeartbeat.objects.filter(owner=beating.owner).exists(), timeout=10
        )
        yield beating
    finally:
        beating.stop()


def poison_job_dead_lettered(smtp_port: int) -> None:
    """``tests.crash`` (3 attempts) kills the pool process running it, on a worker of its own: its
    message is requeued and finds the run still held; once its owner's heartbeat lapsed the rescue
    gives the run back (an attempt spent), until the claim past its attempts records the dead
    letter instead of running it. Asserts that outcome, on whichever broker the run uses."""
    from tests import tasks as test_tasks

    worker = launch.celery_worker(
        worker_env(smtp_port), name="poison", include=("tests.tasks",), concurrency=1
    )
    try:
        worker.wait_ready()
        result = test_tasks.crash.enqueue()
        assert wait_until(DeadLetter.objects.exists, timeout=90), worker.log_text()[-3000:]
    finally:
        worker.stop()
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.reason) == (test_tasks.crash.module_path, "redelivery_limit")
    assert letter.exception_class == "asyncwork.runner.RedeliveredTooOften"
    assert letter.exception_message.startswith("claimed 4 times, more than its 3 attempts")
    assert worker.log_text().count("exited with 'signal 9 (SIGKILL)'") == 3
    job = Job.objects.get(pk=result.id)
    assert (job.status, job.attempts) == (Job.Status.FAILED, 4)
