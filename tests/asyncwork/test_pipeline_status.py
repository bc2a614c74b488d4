"""``manage.py pipeline_status``: one screen with what the operator needs."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection

from asyncwork.contrib.periodic.jobs import job_run, jobs_declared
from invoicing.tasks import send_invoice_email
from stack.process import ROOT
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def status(*args: str) -> str:
    """The command as ``manage.py`` runs it: its system checks first, which load the URLconf,
    whose views declare the backpressure check (``asyncwork.contrib.backpressure``)."""
    out = StringIO()
    call_command("pipeline_status", *args, stdout=out, skip_checks=False)
    return out.getvalue()


def test_json_has_health_queue_depths_and_jobs() -> None:
    job_run(name="dlq-alert", body=lambda: 0)
    send_invoice_email.enqueue(1)  # published to its queue, where no worker reads it

    report = json.loads(status("--json"))

    assert set(report["health"]["checks"]) >= {
        "database",
        "broker",
        "outbox",
        "backpressure",
        "dlq",
        "breaker",
        "beat",
    }
    assert report["queues"]["email"] == 1
    assert "dlq" not in report["queues"]  # RabbitMQ's alone
    alert = next(job for job in report["jobs"] if job["job"] == "dlq-alert")
    assert (alert["runs"], alert["skips"], alert["running_now"]) == (1, 0, None)
    assert alert["last_run"] is not None


def test_screen_names_every_part() -> None:
    screen = status()
    for part in (
        "pipeline:",
        "database",
        "broker",
        "outbox",
        "dlq",
        "breaker",
        "beat",
        "queues: default-recovery=0, default=0, email-recovery=0, email=0\n",
        "dlq-alert",
        "retention-purge",
        "stripe-events-reconcile",
    ):
        assert part in screen
    # Each check's status, and each job's last run, start in one column however long the names.
    lines = screen.splitlines()
    queues_at = next(i for i, line in enumerate(lines) if line.startswith("queues:"))
    checks, jobs = lines[1:queues_at], lines[queues_at + 1 :]
    assert len(checks) >= 9
    assert len(jobs) == 1 + len(jobs_declared())
    assert len({re.match(r"  \S+ +", line).end() for line in checks}) == 1  # type: ignore[union-attr]
    assert len({re.match(r"\S+ +", line).end() for line in jobs}) == 1  # type: ignore[union-attr]


def test_a_running_job_is_shown_with_the_process_running_it() -> None:
    """Not the PostgreSQL backend's pid: the host and pid of the process whose job holds the
    lock (here this test process, whose thread runs the job)."""
    inside, release = threading.Event(), threading.Event()

    def running_job() -> None:
        def body() -> str:
            inside.set()
            release.wait(20)
            return "done"

        try:
            job_run(name="dlq-alert", body=body)
        finally:
            connection.close()

    thread = threading.Thread(target=running_job)
    thread.start()
    try:
        assert inside.wait(10)
        report = json.loads(status("--json"))
        screen = status()
    finally:
        release.set()
        thread.join(20)

    alert = next(job for job in report["jobs"] if job["job"] == "dlq-alert")
    assert alert["running_now"] == {"host": socket.gethostname(), "pid": os.getpid()}
    [line] = [line for line in screen.splitlines() if line.startswith("dlq-alert ")]
    assert line.endswith(f"  pid {os.getpid()} on host {socket.gethostname()}")
    assert report["health"]["checks"]["beat"]["active"] is None
    assert "no beat is dispatching" in screen


@pytest.mark.parametrize("args", [["pipeline_status"], ["pipeline_status", "--json"], ["help"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(args: list[str]) -> None:
    """As ``manage.py pipeline_status | head -1``, with the reader gone before the first line
    is written: every write meets a closed pipe. The command stops without a traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader has stopped reading
    try:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
            env=worker_env(0),
        )
    finally:
        os.close(write)
    assert result.stderr == ""
    assert result.returncode == 1  # as Python's own documentation has it for a closed pipe
