"""GET /health/ against the real PostgreSQL and Redis, and with each of them really gone: the
whole report for a staff session or the metrics token, the status alone (computed once per
second per process, shared by concurrent callers) for anyone else; GET /health/live with no
I/O at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from asyncwork.contrib.backpressure import queues_probe
from asyncwork.contrib.monitoring import health, probes
from asyncwork.models import DeadLetter, Job
from asyncwork.settings import asyncwork_settings
from core.celery import app
from invoicing.tasks import EMAIL_QUEUE, send_invoice_email
from stack.net import free_port

pytestmark = pytest.mark.django_db(transaction=True)  # the checks run on their own connections

HEALTH_URL = "/health/"
LIVE_URL = "/health/live"
COMPONENTS = {
    "database",
    "broker",
    "outbox",
    "backpressure",
    "dlq",
    "breaker",
    "beat",
    "stripe_api",
    "api_versions",
    "stripe_reconcile",
}
TOKEN = "health-test-token"


@pytest.fixture(autouse=True)
def _no_shared_report() -> Iterator[None]:
    """Each test starts without the report another test's anonymous request left behind."""
    health._shared = None
    yield
    health._shared = None


@pytest.fixture
def monitor(settings: Any) -> Client:
    """A monitoring system presenting METRICS_TOKEN: it sees the whole report."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": TOKEN}
    return Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


def unpublished(*, age: timedelta, count: int = 1) -> None:
    rows = Job.objects.bulk_create(
        Job(task=send_invoice_email.module_path, args=[n], queue=EMAIL_QUEUE) for n in range(count)
    )
    Job.objects.filter(pk__in=[r.pk for r in rows]).update(created_at=timezone.now() - age)


def test_healthy_is_200_and_names_every_component(monitor: Client) -> None:
    response = monitor.get(HEALTH_URL)

    assert response.status_code == 200
    body = response.json()
    assert body["failing"] == []
    # No beat runs in this test: "beat" says degraded (not failing: emails still go out).
    assert body["status"] == "degraded"
    assert body["degraded"] == ["beat"]
    assert set(body["checks"]) == COMPONENTS
    for name in ("database", "broker", "outbox", "backpressure", "dlq"):
        assert body["checks"][name]["status"] == "ok", name
    assert body["checks"]["outbox"]["unpublished"] == 0
    assert body["checks"]["outbox"]["oldest_unpublished_age_seconds"] is None
    assert body["checks"]["dlq"]["waiting"] == 0
    assert body["checks"]["backpressure"]["level"] == "normal"
    assert isinstance(body["checks"]["backpressure"]["queue_depth"], int)
    assert body["checks"]["breaker"] == {
        **body["checks"]["breaker"],
        "status": "ok",
        "state": "closed",
    }
    assert body["checks"]["beat"] == {
        **body["checks"]["beat"],
        "status": "degraded",
        "active": None,
    }
    assert response["Cache-Control"] == "no-store"


def test_database_unreachable_is_503_naming_database(monitor: Client) -> None:
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # nothing listens there: a real refused connection
    try:
        response = monitor.get(HEALTH_URL)
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port

    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "failing"
    assert "database" in body["failing"]
    assert "broker" not in body["failing"]
    assert body["checks"]["database"]["error"] == "OperationalError"


def test_broker_unreachable_is_503_naming_broker(
    monitor: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Celery app's broker, whose URL Celery takes from CELERY_BROKER_URL in the environment
    # (which this run sets, tests/settings.py) before its configuration.
    monkeypatch.setenv("CELERY_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")
    assert app.conf.broker_url.startswith("redis://127.0.0.1:")

    response = monitor.get(HEALTH_URL)

    assert response.status_code == 503
    assert response.json()["failing"] == ["broker"]


def test_a_stale_unpublished_outbox_row_is_503_naming_outbox(
    monitor: Client, settings: Any
) -> None:
    unpublished(age=timedelta(seconds=asyncwork_settings.OUTBOX_STALE_SECONDS + 60))

    response = monitor.get(HEALTH_URL)

    assert response.status_code == 503
    body = response.json()
    assert body["failing"] == ["outbox"]
    outbox = body["checks"]["outbox"]
    assert outbox["unpublished"] == 1
    assert outbox["oldest_unpublished_age_seconds"] > asyncwork_settings.OUTBOX_STALE_SECONDS


def test_a_young_backlog_is_healthy(monitor: Client) -> None:
    unpublished(age=timedelta(seconds=30), count=3)
    response = monitor.get(HEALTH_URL)
    assert response.status_code == 200
    assert response.json()["checks"]["outbox"]["unpublished"] == 3


def test_backlog_at_the_hard_mark_is_503_at_the_soft_mark_degraded(
    monitor: Client, settings: Any
) -> None:
    # Messages earlier tests' commits left on the email queue count too: stay above them.
    waiting = queues_probe((EMAIL_QUEUE,)).depths[EMAIL_QUEUE]
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_SOFT_MARK": waiting + 2,
        "BACKPRESSURE_HARD_MARK": waiting + 4,
    }
    unpublished(age=timedelta(seconds=1), count=waiting + 2)
    soft = monitor.get(HEALTH_URL)
    unpublished(age=timedelta(seconds=1), count=2)
    hard = monitor.get(HEALTH_URL)

    assert soft.status_code == 200
    assert sorted(soft.json()["degraded"]) == ["backpressure", "beat"]
    assert soft.json()["checks"]["backpressure"]["level"] == "soft"
    assert hard.status_code == 503
    assert hard.json()["failing"] == ["backpressure"]
    assert hard.json()["checks"]["outbox"]["unpublished_capped"] is True


def test_dead_letters_past_the_threshold_degrade_but_stay_200(
    monitor: Client, settings: Any
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "DLQ_ALERT_THRESHOLD": 1}
    now = timezone.now()
    DeadLetter.objects.create(
        task=send_invoice_email.module_path,
        task_id="health-dlq-1",
        args=[1],
        queue=EMAIL_QUEUE,
        reason=DeadLetter.Reason.PERMANENT,
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
    )

    response = monitor.get(HEALTH_URL)

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "degraded"
    assert body["checks"]["dlq"] == {**body["checks"]["dlq"], "status": "degraded", "waiting": 1}


@pytest.fixture
def extra_checks() -> Iterator[None]:
    saved = dict(probes._probes)
    yield
    probes._probes.clear()
    probes._probes.update(saved)


def check_declare(
    name: str, read: Callable[[], dict[str, Any]], *, critical: bool = True, check_name: str = ""
) -> None:
    """A probe whose reading is its check's result."""
    probes.probe_declare(
        probes.Probe(
            name,
            read,
            database=False,
            check=lambda result: result,
            critical=critical,
            check_name=check_name,
        )
    )


def test_a_check_past_the_deadline_fails_within_the_deadline(
    monitor: Client, settings: Any, extra_checks: None
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "HEALTH_TIMEOUT_SECONDS": 0.5}

    def slow() -> dict[str, Any]:
        time.sleep(3)
        return {"status": "ok"}

    check_declare("slow", slow)

    started = time.monotonic()
    response = monitor.get(HEALTH_URL)
    elapsed = time.monotonic() - started

    assert response.status_code == 503
    assert response.json()["failing"] == ["slow"]
    assert response.json()["checks"]["slow"]["error"] == "timed out after 0.5 s"
    assert elapsed < 2


def test_a_registered_provider_replaces_the_built_in_one(
    monitor: Client, extra_checks: None
) -> None:
    opened = {"status": "degraded", "state": "open"}
    check_declare("email_breaker", lambda: opened, critical=False, check_name="breaker")
    check_declare("beat", lambda: {"never": 1 / 0}, critical=False)  # one that raises
    check_declare("odd", lambda: {"status": "ok", "figure": object()}, critical=False)

    response = monitor.get(HEALTH_URL)

    assert response.status_code == 200  # neither is critical
    checks = response.json()["checks"]
    assert checks["breaker"] == {**checks["breaker"], "status": "degraded", "state": "open"}
    assert checks["beat"] == {**checks["beat"], "status": "failing", "error": "ZeroDivisionError"}
    assert checks["odd"] == {**checks["odd"], "status": "failing", "error": "TypeError"}
    assert sorted(response.json()["degraded"]) == ["beat", "breaker", "odd"]


def test_only_get_and_head(client: Client) -> None:
    assert client.head(HEALTH_URL).status_code == 200
    assert client.post(HEALTH_URL).status_code == 405


def test_anyone_else_gets_the_status_alone(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": TOKEN}
    healthy = client.get(HEALTH_URL)
    wrong_token = client.get(HEALTH_URL, HTTP_AUTHORIZATION="Bearer not-the-token")
    customer = Client()
    customer.force_login(get_user_model().objects.create_user("customer"))

    assert (healthy.status_code, healthy.json()) == (200, {"status": "degraded"})  # no beat
    assert healthy["Cache-Control"] == "no-store"
    assert wrong_token.json() == {"status": "degraded"}
    assert customer.get(HEALTH_URL).json() == {"status": "degraded"}

    health._shared = None
    monkeypatch.setenv("CELERY_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")
    failing = client.get(HEALTH_URL)
    assert (failing.status_code, failing.json()) == (503, {"status": "failing"})


def test_a_staff_session_gets_the_whole_report(client: Client) -> None:
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    body = client.get(HEALTH_URL).json()
    assert set(body["checks"]) == COMPONENTS
    assert body["degraded"] == ["beat"]


def test_a_session_cookie_with_the_database_down_is_503_not_500(client: Client) -> None:
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"
    try:
        response = client.get(HEALTH_URL)
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port

    assert (response.status_code, response.json()) == (503, {"status": "failing"})


def test_concurrent_anonymous_callers_share_one_run_of_the_checks(
    settings: Any, extra_checks: None
) -> None:
    """Sixteen threads ask at once: the checks run once, every caller gets that result; again
    within HEALTH_CACHE_SECONDS: no new run; after it: one more."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "HEALTH_CACHE_SECONDS": 1.0}
    runs: list[float] = []
    runs_lock = threading.Lock()

    def counted() -> dict[str, Any]:
        with runs_lock:
            runs.append(time.monotonic())
        time.sleep(0.3)  # long enough for every caller to arrive while it runs
        return {"status": "ok"}

    check_declare("counted", counted, critical=False)

    callers = 16
    barrier = threading.Barrier(callers)
    answers: list[tuple[int, Any]] = []

    def ask() -> None:
        barrier.wait()
        response = Client().get(HEALTH_URL)
        answers.append((response.status_code, response.json()))

    threads = [threading.Thread(target=ask) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(answers) == callers
    assert answers == [(200, {"status": "degraded"})] * callers
    assert len(runs) == 1
    assert Client().get(HEALTH_URL).status_code == 200
    assert len(runs) == 1  # within the second: the shared result
    time.sleep(1.1)  # the shared result's second is over
    assert Client().get(HEALTH_URL).status_code == 200
    assert len(runs) == 2


def test_live_touches_nothing_and_answers_with_everything_down(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.force_login(get_user_model().objects.create_user("ops", is_staff=True))  # a cookie
    with CaptureQueriesContext(connection) as queries:
        response = client.get(LIVE_URL)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert response["Cache-Control"] == "no-store"
    assert len(queries) == 0

    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # PostgreSQL unreachable
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", nowhere)
    settings.CACHES = {
        "default": {**settings.CACHES["default"], "LOCATION": nowhere},
    }
    try:
        down = client.get(LIVE_URL)
        anonymous = Client().get(LIVE_URL)
        head = Client().head(LIVE_URL)
        assert connection.connection is None  # no connection was even attempted
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port

    assert (down.status_code, anonymous.status_code, head.status_code) == (200, 200, 200)
    assert Client().post(LIVE_URL).status_code == 405


def test_probes_speak_plain_http_even_when_https_is_required(settings: Any) -> None:
    settings.SECURE_SSL_REDIRECT = True
    probe = Client()
    assert probe.get(LIVE_URL).status_code == 200
    assert probe.get(HEALTH_URL).status_code == 200
    assert probe.get("/admin/").status_code == 301  # everything else is redirected
