"""Waiting until the pipeline is quiet, before a test asserts "exactly one".

A test that asserts one email, one row or one dead letter must first give a duplicate every
chance to arrive, and a fixed sleep only guesses how long that takes. ``pipeline_quiet`` waits
until no job is on its way anywhere:

* the jobs: none unpublished and due now (``asyncwork.contrib.backpressure.outbox_waiting``),
  none running;
* the broker (``tests.helpers.broker.jobs_in_broker``): no message waiting on a queue the
  workers consume, and none delivered to a worker and not yet acknowledged (the tasks
  acknowledge late, so a job that is running counts);
* the claims: no ``EmailDelivery`` in its ``sending`` state.

A retry scheduled for later (a job due later) is not on its way yet, and is not waited for.

Call it while the worker still runs, then assert::

    with worker_thread():
        dlq("replay", str(letter.pk))
        pipeline_quiet()
    assert len(smtp.messages) == 1
"""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from asyncwork.contrib.backpressure import outbox_waiting
from asyncwork.models import Job
from invoicing.models import EmailDelivery
from tests.helpers import broker


def pipeline_busy() -> list[str]:
    """What is still on its way, in words; empty when nothing is. Read in the order a job
    travels (job row, broker, claim), so that a job moving on while it is read is found in the
    place it moved to; a job leaves the broker only once acknowledged, after its work."""
    busy = []
    due = list(outbox_waiting(timezone.now()).values_list("pk", "task"))
    if due:
        busy.append(f"{len(due)} job(s) due and unpublished {due[:5]}")
    running = list(Job.objects.filter(status=Job.Status.RUNNING).values_list("pk", "task"))
    if running:
        busy.append(f"{len(running)} job(s) running {running[:5]}")
    busy.extend(f"{n} message(s) in {name}" for name, n in broker.jobs_in_broker().items())
    sending = list(
        EmailDelivery.objects.filter(state=EmailDelivery.State.SENDING).values_list(
            "key", flat=True
        )
    )
    if sending:
        busy.append(f"{len(sending)} claim(s) sending {sending[:5]}")
    return busy


def pipeline_quiet(*, timeout: float = 30.0, settle: float = 0.5) -> None:
    """Return once ``pipeline_busy`` has found nothing on every read for ``settle`` seconds
    (two reads at least); fail the test, naming what is still busy, when something still is
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    while True:
        busy = pipeline_busy()
        now = time.monotonic()
        if busy:
            quiet_since = None
            if now >= deadline:
                pytest.fail(f"the pipeline was not quiet within {timeout} s: {'; '.join(busy)}")
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= settle:
            return
        time.sleep(0.1)
