"""Scheduled jobs: one owner at a time (a PostgreSQL advisory lock), a run whose process
died releases the lock, and every job is safe to run twice."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django_celery_beat.models import PeriodicTask

from core import jobs
from core.locks import advisory_lock, lock_holder
from core.models import ScheduledJob
from invoicing import jobs as invoicing_jobs
from tests import tasks as test_tasks
from tests.conftest import ROOT
from tests.workers import worker_env

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = {
    "outbox-relay": jobs.outbox_relay,
    "email-claims-recover": invoicing_jobs.recover_stale_claims,
    "email-reconcile": invoicing_jobs.reconcile_paid_invoices,
    "dlq-alert": jobs.dlq_alert,
    "retention-purge": jobs.retention_purge,
}


def test_every_declared_schedule_has_a_task() -> None:
    assert {s.name for s in jobs.SCHEDULES} == set(TASKS)
    assert {s.task for s in jobs.SCHEDULES} == {t.name for t in TASKS.values()}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_two_concurrent_runs_one_does_the_work(name: str, caplog: pytest.LogCaptureFixture) -> None:
    inside, release = threading.Event(), threading.Event()
    outcomes: dict[str, jobs.JobOutcome] = {}

    def first_run() -> None:
        def body() -> Any:
            inside.set()
            release.wait(10)  # hold the lock while the second run arrives
            return "done"

        try:
            outcomes["first"] = jobs.job_run(name=name, body=body)
        finally:
            connection.close()

    thread = threading.Thread(target=first_run)
    thread.start()
    assert inside.wait(10)
    with caplog.at_level(logging.INFO, logger="core.jobs"):
        second = TASKS[name].apply().get()  # the real task, as a worker runs it
    release.set()
    thread.join(10)

    assert outcomes["first"].ran
    assert second is None  # skipped: nothing done, no result
    assert f"job {name} skipped: another run holds its lock" in caplog.text
    row = ScheduledJob.objects.get(name=name)
    assert (row.runs, row.skips) == (1, 1)
    assert row.last_skipped_at is not None
    assert row.last_holder


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_job_is_safe_to_run_twice_in_a_row(name: str) -> None:
    TASKS[name].apply().get()
    TASKS[name].apply().get()
    row = ScheduledJob.objects.get(name=name)
    assert (row.runs, row.skips, row.last_error) == (2, 0, "")


def test_a_failed_run_is_one_error_line_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Run by Celery's tracer, as a worker runs it: job_run's line, not Celery's as well."""
    with caplog.at_level(logging.INFO):
        result = test_tasks.failing_job.apply()
    assert isinstance(result.result, ZeroDivisionError)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [(r.name, r.getMessage()) for r in errors] == [
        ("core.jobs", f"job {test_tasks.FAILING_JOB} failed")
    ]
    assert errors[0].exc_info is not None
    assert errors[0].exc_info[0] is ZeroDivisionError
    row = ScheduledJob.objects.get(name=test_tasks.FAILING_JOB)
    assert row.last_error == "ZeroDivisionError('division by zero')"


def test_a_run_whose_process_died_releases_the_lock() -> None:
    script = (
        "import time; from django.db import connection;"
        "from core.locks import advisory_lock;"
        "cm = advisory_lock('job:outbox-relay'); held = cm.__enter__();"
        "print('held' if held else 'busy', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", script],
        cwd=ROOT,
        env=worker_env(0),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        assert "(pid " in (lock_holder("job:outbox-relay") or "")
        with advisory_lock("job:outbox-relay") as held:
            assert not held
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        deadline = time.monotonic() + 5
        taken = False
        while not taken and time.monotonic() < deadline:
            with advisory_lock("job:outbox-relay") as held:
                taken = held
            time.sleep(0.05)
        assert taken
    finally:
        proc.kill()


def test_setup_periodic_tasks_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    call_command("setup_periodic_tasks")
    assert "5 created" in capsys.readouterr().out
    call_command("setup_periodic_tasks")
    assert "0 created, 0 updated, 5 unchanged, 0 disabled" in capsys.readouterr().out
    relay = PeriodicTask.objects.get(name="outbox-relay")
    assert (relay.task, relay.interval.every, relay.expire_seconds) == (  # type: ignore[union-attr]
        "core.outbox_relay",
        15,
        15,
    )
    purge = PeriodicTask.objects.get(name="retention-purge")
    assert (purge.crontab.minute, purge.crontab.hour) == ("17", "3")  # type: ignore[union-attr]
    PeriodicTask.objects.filter(name="dlq-alert").update(description=jobs.__name__)
    PeriodicTask.objects.create(
        name="gone", task="core.gone", interval=relay.interval, description=relay.description
    )
    call_command("setup_periodic_tasks")
    out = capsys.readouterr().out
    assert "1 updated" in out
    assert "1 disabled" in out
    assert not PeriodicTask.objects.get(name="gone").enabled
    assert set(ScheduledJob.objects.values_list("name", flat=True)) == set(TASKS)
