"""The operator's dashboard in the admin, read after real rows were stored and the real breaker
opened: each figure is right, links to the list that holds exactly what it counts, and agrees
with /health/ and /metrics (the same probes); a probe that fails is shown failing and hides
nothing else; only staff who may view the lists see it, and the admin's index links it (where
it is routed)."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import DatabaseError, connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import path
from django.utils import timezone

from asyncwork import broker
from asyncwork.contrib.monitoring import probes
from asyncwork.contrib.periodic import jobs
from asyncwork.deadletters import record, replay
from asyncwork.errors import PermanentError, TransientError
from asyncwork.models import DeadLetter, Job, WorkerHeartbeat
from invoicing.models import EmailDelivery
from invoicing.tasks import EMAIL_QUEUE, email_breaker, send_invoice_email
from tests.helpers.admin import rows
from tests.helpers.dashboard import DASHBOARD, dashboard
from tests.helpers.factories import paid_invoice, staff_user
from tests.helpers.metrics import scrape, value
from tests.helpers.processes import a_lapsed_and_a_live_worker

pytestmark = pytest.mark.django_db(transaction=True)  # probes run on the real connections


def letter(n: int, *, reason: str, replayed: bool = False) -> DeadLetter:
    exc = TransientError("SMTP unavailable") if reason == "exhausted" else PermanentError("no")
    stored = record(
        task=send_invoice_email.module_path,
        task_id=f"dashboard-{n}",
        args=[n],
        kwargs={},
        queue=EMAIL_QUEUE,
        reason=reason,
        exc=exc,
        traceback="",
        attempts=5 if reason == "exhausted" else 1,
    )
    assert stored is not None
    if replayed:
        assert replay(ids=[stored.pk], actor="test").replayed == [stored.pk]
    return stored


def delivery(key: str, *, state: str, sent_ago: timedelta | None = None) -> EmailDelivery:
    invoice = paid_invoice()
    return EmailDelivery.objects.create(
        key=f"{key}:{invoice.pk}",
        invoice=invoice,
        state=state,
        attempts=1,
        message_id=f"<{key}.{invoice.pk}@example.com>",
        sent_at=None if sent_ago is None else timezone.now() - sent_ago,
    )


def test_each_figure_is_right_links_to_what_it_counts_and_agrees_with_health_and_metrics(
    viewer: Client, settings: Any
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": "dashboard-test-token"}
    monitor = Client(HTTP_AUTHORIZATION="Bearer dashboard-test-token")
    recent = [
        delivery("invoice_email_sent", state="sent", sent_ago=timedelta(minutes=m)) for m in (5, 50)
    ]
    earlier = delivery("invoice_email_sent", state="sent", sent_ago=timedelta(hours=5))
    delivery("invoice_email_sent", state="sent", sent_ago=timedelta(days=3))
    failed = delivery("invoice_email_sent", state="failed")
    permanent = [letter(1, reason="permanent"), letter(2, reason="permanent")]
    exhausted = letter(3, reason="exhausted")
    letter(4, reason="permanent", replayed=True)
    stuck = Job.objects.bulk_create(
        Job(task="core.nothing", args=[n], queue=broker.DEFAULT) for n in range(3)
    )
    Job.objects.filter(pk=stuck[0].pk).update(created_at=timezone.now() - timedelta(minutes=10))
    breaker = email_breaker()
    for _ in range(breaker.threshold):
        breaker.record_failure()
    jobs.job_task("dlq-alert").apply().get()

    page = dashboard(viewer)

    assert list(page.figures) == [
        "dlq",
        "outbox",
        "queues",
        "beat",
        "workers",
        "scheduled_jobs",
        "emails",
        "email_breaker",
        "stripe_reconcile",
    ]
    assert page.errors == {}
    assert set(page.ms) == set(page.figures)
    assert all(ms >= 0 for ms in page.ms.values())
    emails = page.figures["emails"]
    assert emails["sent in the last hour"]["value"] == "2"
    assert emails["sent in the last day"]["value"] == "3"
    assert emails["failed (retrying, or dead-lettered)"]["value"] == "1"
    listed = rows(viewer.get(emails["sent in the last hour"]["href"]))
    assert sorted(row["key"] for row in listed) == sorted(d.key for d in recent)
    listed = rows(viewer.get(emails["sent in the last day"]["href"]))
    assert sorted(row["key"] for row in listed) == sorted(d.key for d in [*recent, earlier])
    listed = rows(viewer.get(emails["failed (retrying, or dead-lettered)"]["href"]))
    assert [row["key"] for row in listed] == [failed.key]

    dlq = page.figures["dlq"]
    assert dlq["waiting"]["value"] == "3"
    assert dlq["waiting: Permanent failure"]["value"] == "2"
    assert dlq["waiting: Retries exhausted"]["value"] == "1"
    assert "waiting: Provider unavailable" not in dlq
    assert dlq["waiting"]["status"] == "degraded"  # past DLQ_ALERT_THRESHOLD (1)
    listed = rows(viewer.get(dlq["waiting: Permanent failure"]["href"]))
    assert sorted(row["id"] for row in listed) == sorted(str(x.pk) for x in permanent)
    listed = rows(viewer.get(dlq["waiting: Retries exhausted"]["href"]))
    assert [row["id"] for row in listed] == [str(exhausted.pk)]
    assert len(rows(viewer.get(dlq["waiting"]["href"]))) == 3

    outbox = page.figures["outbox"]
    assert outbox["unpublished"]["value"] == "3"
    assert outbox["oldest unpublished"]["value"] == "10 m"
    listed = rows(viewer.get(outbox["unpublished"]["href"]))
    assert sorted(row["id"] for row in listed) == sorted(str(row.pk) for row in stuck)
    # The replayed job waits on the email queue. The dead letters are rows only: on Redis
    # there is no dlq queue to show.
    queue_figures = page.figures["queues"]
    assert queue_figures["waiting on email"]["value"] == "1"
    assert "waiting on dlq" not in queue_figures

    breaker_figures = page.figures["email_breaker"]
    assert breaker_figures["state"]["value"] == "open"
    assert breaker_figures["state"]["status"] == "degraded"
    assert breaker_figures["consecutive failures"]["value"] == "5"
    assert breaker_figures["next probe in"]["value"].endswith(" s")
    beat = page.figures["beat"]["leader"]
    assert beat["value"] == "none: scheduled jobs are not dispatched"
    assert beat["status"] == "degraded"
    # The schedules (every declared job's, synced by migrate).
    assert {row["name"] for row in rows(viewer.get(beat["href"]))} == {
        schedule.name for schedule in jobs.jobs_declared()
    }
    scheduled = page.figures["scheduled_jobs"]
    assert scheduled["dlq-alert"]["value"] == "last ran 0 s ago"
    assert scheduled["retention-purge"]["value"] == "never ran"
    assert viewer.get(scheduled["dlq-alert"]["href"]).status_code == 200

    # /health/ and /metrics read the same probes: the same figures.
    report = monitor.get("/health/").json()["checks"]
    assert report["outbox"]["unpublished"] == 3
    assert report["dlq"]["waiting"] == 3
    assert (report["breaker"]["state"], report["breaker"]["failures"]) == ("open", 5)
    assert report["beat"]["active"] is None
    samples = scrape(monitor)
    assert value(samples, "invoicing_outbox_backlog") == 3
    assert value(samples, "invoicing_dlq_depth") == 3
    assert value(samples, "invoicing_broker_queue_depth", queue="email") == 1


def test_live_workers_are_shown_by_their_heartbeat(viewer: Client) -> None:
    """A process beating (a real heartbeat thread, on its own connection) is live on its host;
    a row whose last beat is older than the lapse is shown lapsed; a stopped heartbeat deletes
    its row."""
    with a_lapsed_and_a_live_worker() as beating:
        workers = dashboard(viewer).figures["workers"]
    assert workers["live worker processes"]["value"] == "1"
    assert workers["live worker processes"]["status"] == "ok"
    assert workers[f"live on {socket.gethostname()}"]["value"] == "1"
    assert "live on gone-host" not in workers
    assert workers["lapsed (no heartbeat for 6 s)"]["value"] == "1"
    assert workers["lapsed (no heartbeat for 6 s)"]["status"] == "degraded"
    assert not WorkerHeartbeat.objects.filter(owner=beating.owner).exists()
    after = dashboard(viewer).figures["workers"]
    assert after["live worker processes"]["value"] == "0"
    assert after["live worker processes"]["status"] == "degraded"


def test_the_outbox_backlog_is_counted_up_to_the_hard_mark_everywhere(
    viewer: Client, settings: Any
) -> None:
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_HARD_MARK": 5,
        "BACKPRESSURE_SOFT_MARK": 4,
        "METRICS_TOKEN": "dashboard-test-token",
    }
    monitor = Client(HTTP_AUTHORIZATION="Bearer dashboard-test-token")
    Job.objects.bulk_create(
        Job(task="core.nothing", args=[n], queue=broker.DEFAULT) for n in range(7)
    )

    assert dashboard(viewer).figures["outbox"]["unpublished"]["value"] == "5+"
    report = monitor.get("/health/").json()["checks"]["outbox"]
    assert (report["unpublished"], report["unpublished_capped"]) == (5, True)
    assert value(scrape(monitor), "invoicing_outbox_backlog") == 5


def test_a_failing_probe_is_shown_failing_and_the_others_are_still_read(
    viewer: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise RuntimeError("host db-7.internal:5432 is on fire")

    def database_down() -> None:
        raise DatabaseError("connection refused")

    monkeypatch.setattr(
        probes,
        "_probes",
        {
            "broken": probes.Probe("broken", broken, database=False, figures=lambda _: []),
            **probes._probes,
        },
    )
    page = dashboard(viewer)
    assert page.errors == {"broken": "RuntimeError"}  # the class only: no host names
    assert page.figures["dlq"]["waiting"]["value"] == "0"
    assert page.figures["email_breaker"]["state"]["value"] == "closed"

    # After a database error, the other database probes are skipped (one timeout, not one
    # each), and the rest are still read.
    monkeypatch.setattr(
        probes,
        "_probes",
        {
            "down": probes.Probe("down", database_down, database=True, figures=lambda _: []),
            **{name: p for name, p in probes._probes.items() if name != "broken"},
        },
    )
    page = dashboard(viewer)
    assert page.errors["down"] == "DatabaseError"
    for name in ("outbox", "dlq", "beat", "scheduled_jobs", "emails"):
        assert page.errors[name] == "skipped: the database failed", name
    assert "queues" not in page.errors
    assert page.figures["email_breaker"]["state"]["value"] == "closed"


def test_what_a_render_costs_does_not_grow_with_the_rows(viewer: Client) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            dashboard(viewer)
        return len(captured)

    letter(1, reason="permanent")
    delivery("invoice_email_sent", state="sent", sent_ago=timedelta(minutes=1))
    few = queries()
    for n in range(2, 40):
        letter(n, reason="exhausted" if n % 2 else "permanent")
        delivery("invoice_email_sent", state="sent", sent_ago=timedelta(minutes=n))
    assert queries() == few


def test_only_staff_who_may_view_the_lists_see_it_and_the_index_links_it(viewer: Client) -> None:
    index = viewer.get("/admin/").content.decode()
    assert f'href="{DASHBOARD}"' in index

    nobody = Client()
    nobody.force_login(staff_user("nobody"))  # staff, no permission
    assert nobody.get(DASHBOARD).status_code == 403
    assert f'href="{DASHBOARD}"' not in nobody.get("/admin/").content.decode()
    customer = Client()
    customer.force_login(get_user_model().objects.create_user("customer"))  # not staff
    assert customer.get(DASHBOARD)["Location"].startswith("/admin/login/")
    assert Client().get(DASHBOARD)["Location"].startswith("/admin/login/")
    assert viewer.post(DASHBOARD).status_code == 405


# The admin's URLs without asyncwork.contrib.monitoring's.
urlpatterns = [path("admin/", admin.site.urls)]


@pytest.mark.urls(__name__)
def test_where_the_dashboard_is_not_routed_the_index_links_nothing(viewer: Client) -> None:
    index = viewer.get("/admin/")

    assert index.status_code == 200
    assert "Dead letters" in index.content.decode()
    assert 'id="operator-dashboard"' not in index.content.decode()
