"""Scheduled jobs: one owner at a time (a PostgreSQL advisory lock), a run whose process
died releases the lock, and every job is safe to run twice."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from io import StringIO
from typing import Any

import psycopg
import pytest
from celery import current_app
from django.core.management import call_command
from django.db import connection, transaction
from django_celery_beat.models import (
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    PeriodicTasks,
)

from asyncwork.contrib.periodic import jobs
from asyncwork.contrib.periodic.locks import Holder, advisory_lock, advisory_xact_lock, lock_holder
from asyncwork.models import ScheduledJob
from stack import launch
from stack.net import free_port
from stack.process import ROOT
from tests import tasks as test_tasks
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = ("dlq-alert", "retention-purge", "stripe-events-reconcile")


def test_every_declared_job_has_one_name_for_its_task_and_lock() -> None:
    assert {s.name for s in jobs.jobs_declared()} == set(JOBS)
    for name in JOBS:
        assert jobs.job_task(name).name == name
        assert current_app.tasks[name].name == name  # registered with the app


@pytest.mark.parametrize("name", sorted(JOBS))
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
    with caplog.at_level(logging.INFO, logger="asyncwork.contrib.periodic.jobs"):
        second = jobs.job_task(name).apply().get()  # the real task, as a worker runs it
    release.set()
    thread.join(10)

    assert outcomes["first"].ran
    assert second is None  # skipped: nothing done, no result
    assert f"job {name} skipped: another run holds its lock" in caplog.text
    row = ScheduledJob.objects.get(name=name)
    assert (row.runs, row.skips) == (1, 1)
    assert row.last_skipped_at is not None
    assert row.last_holder == f"pid {os.getpid()} on host {socket.gethostname()}"


@pytest.mark.parametrize("name", sorted(JOBS))
def test_each_job_is_safe_to_run_twice_in_a_row(name: str) -> None:
    jobs.job_task(name).apply().get()
    jobs.job_task(name).apply().get()
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
        ("asyncwork.contrib.periodic.jobs", f"job {test_tasks.FAILING_JOB} failed")
    ]
    assert errors[0].exc_info is not None
    assert errors[0].exc_info[0] is ZeroDivisionError
    row = ScheduledJob.objects.get(name=test_tasks.FAILING_JOB)
    assert row.last_error == "ZeroDivisionError('division by zero')"


@pytest.mark.slow
def test_a_run_whose_process_died_releases_the_lock() -> None:
    script = (
        "import time; from django.db import connection;"
        "from asyncwork.contrib.periodic.locks import advisory_lock;"
        "cm = advisory_lock('job:dlq-alert'); held = cm.__enter__();"
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
        assert lock_holder("job:dlq-alert") == Holder(host=socket.gethostname(), pid=proc.pid)
        with advisory_lock("job:dlq-alert") as held:
            assert not held
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        deadline = time.monotonic() + 5
        taken = False
        while not taken and time.monotonic() < deadline:
            with advisory_lock("job:dlq-alert") as held:
                taken = held
            time.sleep(0.05)
        assert taken
    finally:
        proc.kill()


def test_setup_periodic_tasks_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    PeriodicTask.objects.all().delete()  # migrate synced them already
    call_command("setup_periodic_tasks")
    assert f"{len(JOBS)} created" in capsys.readouterr().out
    call_command("setup_periodic_tasks")
    assert f"0 created, 0 updated, {len(JOBS)} unchanged, 0 disabled" in capsys.readouterr().out
    alert = PeriodicTask.objects.get(name="dlq-alert")
    assert (alert.task, alert.interval.every, alert.expire_seconds) == ("dlq-alert", 300, 300)
    purge = PeriodicTask.objects.get(name="retention-purge")
    assert (purge.crontab.minute, purge.crontab.hour) == ("17", "3")
    PeriodicTask.objects.filter(name="retention-purge").update(description=jobs.__name__)
    PeriodicTask.objects.create(
        name="gone", task="core.gone", interval=alert.interval, description=alert.description
    )
    call_command("setup_periodic_tasks")
    out = capsys.readouterr().out
    assert "1 updated" in out
    assert "1 disabled" in out
    assert not PeriodicTask.objects.get(name="gone").enabled
    assert set(ScheduledJob.objects.values_list("name", flat=True)) == set(JOBS)


def beat_tables() -> list[tuple[str, ...]]:
    """Every row beat reads for the declared jobs, and the schedules they point to."""
    return [
        *PeriodicTask.objects.order_by("name").values_list(
            "pk", "name", "task", "enabled", "interval__every", "crontab__hour", "expire_seconds"
        ),
        *((str(n), "intervals") for n in [IntervalSchedule.objects.count()]),
        *((str(n), "crontabs") for n in [CrontabSchedule.objects.count()]),
    ]


@pytest.mark.django_db  # the database as migrate made it, rolled back after the test
def test_the_database_migrate_made_has_every_declared_schedule() -> None:
    """The test database is created by migrate alone (pytest-django): no setup_periodic_tasks."""
    assert jobs.schedules_missing() == []
    assert set(PeriodicTask.objects.values_list("name", "task", "enabled")) >= {
        (s.name, s.name, True) for s in jobs.jobs_declared()
    }


def test_migrate_syncs_the_schedules_and_a_second_migrate_changes_nothing() -> None:
    PeriodicTask.objects.all().delete()
    IntervalSchedule.objects.all().delete()
    CrontabSchedule.objects.all().delete()
    ScheduledJob.objects.all().delete()
    assert [s.name for s in jobs.schedules_missing()] == [s.name for s in jobs.jobs_declared()]

    first = StringIO()
    call_command("migrate", "--noinput", stdout=first)
    assert (
        f"periodic tasks: {len(JOBS)} created, 0 updated, 0 unchanged, 0 disabled"
        in first.getvalue()
    )
    assert jobs.schedules_missing() == []
    alert = PeriodicTask.objects.get(name="dlq-alert")
    assert (alert.task, alert.interval.every, alert.expire_seconds) == ("dlq-alert", 300, 300)
    assert set(ScheduledJob.objects.values_list("name", flat=True)) == set(JOBS)
    before = beat_tables()
    changed = PeriodicTasks.last_change()

    second = StringIO()
    call_command("migrate", "--noinput", stdout=second)
    assert (
        f"periodic tasks: 0 created, 0 updated, {len(JOBS)} unchanged, 0 disabled"
        in second.getvalue()
    )
    assert beat_tables() == before
    assert PeriodicTasks.last_change() == changed  # beat is not told to reload anything


def test_two_syncs_at_once_take_turns_and_create_each_schedule_once() -> None:
    PeriodicTask.objects.all().delete()
    IntervalSchedule.objects.all().delete()
    CrontabSchedule.objects.all().delete()

    # While another transaction holds the sync lock, a sync waits for it.
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                advisory_xact_lock(jobs.SYNC_LOCK)
                holding.set()
                release.wait(10)
        finally:
            connection.close()

    results: list[dict[str, int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def sync() -> None:
        try:
            start.wait(10)
            results.append(jobs.schedules_sync())
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    syncs = [threading.Thread(target=sync) for _ in range(2)]
    for thread in syncs:
        thread.start()
    time.sleep(1)
    assert results == []  # both wait for the lock
    assert not PeriodicTask.objects.exists()
    release.set()
    holder.join(10)
    for thread in syncs:
        thread.join(30)

    assert errors == []
    assert sorted(r["created"] for r in results) == [
        0,
        len(JOBS),
    ]  # one created, the other found them
    assert sorted(r["unchanged"] for r in results) == [0, len(JOBS)]
    assert PeriodicTask.objects.count() == len(jobs.jobs_declared())
    # One interval per distinct period, one crontab: no duplicates.
    periods = {int(j.every.total_seconds()) for j in jobs.jobs_declared() if j.every}
    assert sorted(IntervalSchedule.objects.values_list("every", flat=True)) == sorted(periods)
    assert CrontabSchedule.objects.count() == 1


@pytest.mark.slow
def test_migrate_on_an_empty_database_syncs_the_schedules_once_the_tables_exist() -> None:
    """A real manage.py migrate on a database of this test's own, created empty: migrating core
    alone (django-celery-beat's tables not there yet) syncs nothing and does not fail; the full
    migrate syncs every schedule; the next changes nothing."""
    fresh = f"{connection.settings_dict['NAME']}_fresh"
    db = connection.settings_dict
    env = {
        **worker_env(0),
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{fresh}",
    }

    def migrate(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        return done.stdout

    def fresh_rows(sql: str) -> list[tuple[object, ...]]:
        params = connection.get_connection_params()
        for django_only in ("cursor_factory", "context", "prepare_threshold"):
            params.pop(django_only, None)
        params["dbname"] = fresh
        with psycopg.connect(**params) as conn:
            return list(conn.execute(sql).fetchall())

    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')
        cursor.execute(f'CREATE DATABASE "{fresh}"')
    try:
        out = migrate("asyncwork")
        assert "periodic tasks not synced: django_celery_beat or asyncwork has unapplied" in out
        assert fresh_rows("SELECT to_regclass('django_celery_beat_periodictask') IS NULL") == [
            (True,)
        ]

        out = migrate()
        assert f"periodic tasks: {len(JOBS)} created, 0 updated, 0 unchanged, 0 disabled" in out
        names = fresh_rows("SELECT name, task FROM django_celery_beat_periodictask WHERE enabled")
        assert set(names) == {(s.name, s.name) for s in jobs.jobs_declared()}

        out = migrate()
        assert "No migrations to apply." in out
        assert f"periodic tasks: 0 created, 0 updated, {len(JOBS)} unchanged, 0 disabled" in out
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')


@pytest.mark.parametrize(
    ("result", "level"), [(0, logging.DEBUG), ({}, logging.DEBUG), (3, logging.INFO)]
)
def test_a_run_that_found_nothing_is_logged_at_debug(
    result: Any, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="asyncwork.contrib.periodic.jobs"):
        jobs.job_run(name="dlq-alert", body=lambda: result)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (level, f"job dlq-alert ran: {result}")
    ]


# The idle worker's test: every job every 2 s, about 10 runs of each in IDLE_SECONDS.
ROUTINE_EVERY = 2
IDLE_SECONDS = 20


@pytest.mark.slow
def test_an_idle_worker_writes_no_line_at_info_while_its_jobs_find_nothing() -> None:
    """A real worker and beat at INFO on an idle database, every job scheduled every 2 s (its
    schedule is every 5 or 10 minutes, or daily): in 20 s each job runs about ten times, finding
    nothing, and the worker writes no line after "ready." (the budget is one a minute). At DEBUG
    the same runs are logged: Celery's lines and the job's, demoted, not dropped."""
    call_command("setup_periodic_tasks", stdout=StringIO())
    every, _ = IntervalSchedule.objects.get_or_create(every=ROUTINE_EVERY, period="seconds")
    PeriodicTask.objects.filter(name__in=JOBS).update(
        interval=every, crontab=None, expire_seconds=ROUTINE_EVERY
    )
    PeriodicTasks.update_changed()

    def idle(level: str) -> tuple[str, dict[str, int]]:
        """The worker's log after "ready.", and how many times each job ran meanwhile."""
        ScheduledJob.objects.update(runs=0)
        env = worker_env(free_port(), LOG_LEVEL=level)
        with (
            launch.celery_worker(env, name=f"idle-{level}", loglevel=level) as worker,
            launch.celery_beat(env, name=f"idle-beat-{level}", loglevel=level),
        ):
            time.sleep(IDLE_SECONDS)
            log = worker.log_text()
        runs = dict(ScheduledJob.objects.values_list("name", "runs"))
        return log.partition(" ready.\n")[2], runs

    after_ready, runs = idle("INFO")
    assert all(runs[name] >= IDLE_SECONDS // ROUTINE_EVERY // 2 for name in JOBS), runs
    assert after_ready.splitlines() == []
    print(f"INFO: {sum(runs.values())} job runs in {IDLE_SECONDS} s, no line")

    after_ready, runs = idle("DEBUG")
    assert all(runs[name] >= 1 for name in JOBS), runs
    for name in JOBS:
        assert f" DEBUG celery.worker.strategy Task {name}[" in after_ready
        assert f" DEBUG asyncwork.contrib.periodic.jobs job {name} ran: " in after_ready
        assert f" DEBUG celery.app.trace Task {name}[" in after_ready
