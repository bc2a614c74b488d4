"""The probes /health/, /metrics and the dashboard read, against real rows in PostgreSQL and
real queues and breaker state in Redis: what each measures, its bound, and the registry that
reads them one by one without letting one failure hide the rest."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.utils import OperationalError
from django.utils import timezone

from asyncwork import broker
from asyncwork.contrib.backpressure import queues_probe
from asyncwork.contrib.monitoring import probes
from asyncwork.contrib.monitoring.probes import (
    BreakerProbe,
    Figure,
    Probe,
    bounded,
    breaker_probe,
    dlq_probe,
    outbox_probe,
    probe_declare,
    probes_read,
    scheduled_jobs_probe,
)
from asyncwork.contrib.periodic import jobs
from asyncwork.deadletters import record, replay
from asyncwork.errors import PermanentError
from asyncwork.models import Job, ScheduledJob
from core.celery import app
from invoicing.tasks import EMAIL_QUEUE, email_breaker
from stack.net import free_port
from tests import tasks as test_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def unpublished(count: int, *, age: timedelta = timedelta(0)) -> list[Job]:
    rows = Job.objects.bulk_create(
        Job(task="core.nothing", args=[n], queue=broker.DEFAULT) for n in range(count)
    )
    Job.objects.filter(pk__in=[r.pk for r in rows]).update(created_at=timezone.now() - age)
    return rows


def test_the_outbox_probe_counts_up_to_the_hard_mark_and_dates_the_oldest(settings: Any) -> None:
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_HARD_MARK": 4,
        "OUTBOX_STALE_SECONDS": 300,
    }
    assert outbox_probe().unpublished == 0
    assert outbox_probe().oldest_age_seconds is None
    unpublished(2, age=timedelta(minutes=10))
    published = unpublished(4)
    Job.objects.filter(pk__in=[r.pk for r in published[:3]]).update(published_at=timezone.now())

    with bounded():
        probe = outbox_probe()

    assert (probe.unpublished, probe.capped) == (3, False)
    assert probe.oldest_age_seconds is not None
    assert 600 <= probe.oldest_age_seconds < 660
    assert probe.stale
    unpublished(5)
    assert (outbox_probe().unpublished, outbox_probe().capped) == (4, True)


def test_a_job_due_later_is_no_backlog_and_one_come_due_has_waited_since_its_due_time(
    settings: Any,
) -> None:
    """A job waiting for its time (``run_after``, a retry's backoff) is not behind; once due and
    unpublished it is, and has waited since it came due, not since it was enqueued."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "OUTBOX_STALE_SECONDS": 300}
    [later, due] = unpublished(2, age=timedelta(hours=2))
    now = timezone.now()
    Job.objects.filter(pk=later.pk).update(due_at=now + timedelta(hours=1))
    Job.objects.filter(pk=due.pk).update(due_at=now - timedelta(minutes=1))

    probe = outbox_probe()

    assert probe.unpublished == 1
    assert probe.oldest_age_seconds is not None
    assert 60 <= probe.oldest_age_seconds < 120
    assert not probe.stale


def test_the_dlq_probe_counts_the_waiting_by_reason() -> None:
    letters = [
        record(
            task=test_tasks.pid.module_path,  # a task of this code: replayed, not refused
            task_id=f"probe-{n}",
            args=[n],
            kwargs={},
            queue=broker.DEFAULT,
            reason=reason,
            exc=PermanentError("no"),
            traceback="",
            attempts=1,
        )
        for n, reason in enumerate(["permanent", "permanent", "exhausted", "permanent"])
    ]
    assert all(letters)
    first = letters[0]
    assert first is not None
    assert replay(ids=[first.pk], actor="test").replayed == [first.pk]

    probe = dlq_probe()

    assert probe.waiting_by_reason == {"exhausted": 1, "permanent": 2}
    assert probe.waiting == 3
    assert probe.oldest_age_seconds is not None
    assert 0 <= probe.oldest_age_seconds < 60


def test_the_scheduled_jobs_probe_lists_every_declared_job_and_any_other_that_ran() -> None:
    jobs.job_task("dlq-alert").apply().get()
    ScheduledJob.objects.create(name="retired-job", runs=3, last_error="boom")

    states = {job.name: job for job in scheduled_jobs_probe()}

    assert set(states) == {schedule.name for schedule in jobs.jobs_declared()} | {"retired-job"}
    assert states["dlq-alert"].runs == 1
    assert states["dlq-alert"].last_started_at is not None
    # Declared, never run: its row exists from migrate on
    # (asyncwork.contrib.periodic.jobs.schedules_sync).
    assert states["retention-purge"].runs == 0
    assert states["retention-purge"].last_started_at is None
    assert states["retired-job"].last_error == "boom"


def test_the_queues_probe_counts_each_queue_in_one_round_trip() -> None:
    for _ in range(3):
        app.send_task("core.nothing", queue=EMAIL_QUEUE)
    app.send_task("core.nothing", queue=broker.DEFAULT, priority=9)  # another priority list

    assert queues_probe().depths == {
        broker.DEFAULT: 1,
        broker.ahead(broker.DEFAULT): 0,
        broker.ahead(EMAIL_QUEUE): 0,
        EMAIL_QUEUE: 3,
    }
    assert queues_probe((EMAIL_QUEUE,)).depths == {EMAIL_QUEUE: 3}


def test_the_breaker_probe_reads_the_shared_state_and_says_unknown_without_redis(
    settings: Any,
) -> None:
    breaker = email_breaker()
    assert breaker_probe(breaker).state == "closed"
    for _ in range(breaker.threshold):
        breaker.record_failure()

    probe = breaker_probe(breaker)

    assert (probe.name, probe.state, probe.failures) == ("email", "open", breaker.threshold)
    assert 0 < probe.retry_in <= breaker.reset_seconds
    assert probe.status == "degraded"
    settings.ASYNCWORK = {**settings.ASYNCWORK, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    assert breaker_probe(email_breaker()).state == "unknown"


def test_a_bounded_probe_gives_up_at_the_probe_timeout(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "PROBE_TIMEOUT_SECONDS": 0.2}
    with pytest.raises(OperationalError, match="statement timeout"), bounded():
        connection.cursor().execute("SELECT pg_sleep(2)")


def test_declared_probes_are_read_in_order_each_bounded_and_a_failure_hides_nothing(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "PROBE_TIMEOUT_SECONDS": 0.2}
    monkeypatch.setattr(probes, "_probes", {})

    def slow() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(2)")
        return 1

    def breaker() -> BreakerProbe:
        return breaker_probe(email_breaker())

    def counted(n: int) -> list[Figure]:
        return [Figure("n", str(n))]

    probe_declare(Probe("outbox", outbox_probe, database=True, figures=counted_outbox))
    probe_declare(Probe("slow", slow, database=True, figures=counted))
    probe_declare(Probe("unshown", dlq_probe, database=True))  # no figures: not read
    probe_declare(Probe("dlq", dlq_probe, database=True, figures=counted_dlq))
    probe_declare(Probe("breaker", breaker, database=False, figures=breaker_state))

    readings = {reading.probe.name: reading for reading in probes_read("figures")}

    assert list(readings) == ["outbox", "slow", "dlq", "breaker"]
    assert readings["outbox"].shown == [Figure("unpublished", "0")]
    assert readings["slow"].error == "OperationalError"  # the statement timed out
    assert readings["slow"].ms < 1500
    assert readings["dlq"].error == "skipped: the database failed"
    assert readings["breaker"].shown == [Figure("state", "closed")]
    assert all(reading.ms >= 0 for reading in readings.values())


def counted_outbox(probe: probes.OutboxProbe) -> list[Figure]:
    return [Figure("unpublished", str(probe.unpublished))]


def counted_dlq(probe: probes.DlqProbe) -> list[Figure]:
    return [Figure("waiting", str(probe.waiting))]


def breaker_state(probe: BreakerProbe) -> list[Figure]:
    return [Figure("state", probe.state)]
