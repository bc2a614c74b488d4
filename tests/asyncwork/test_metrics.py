"""GET /metrics and the worker's metrics port, scraped after real work: webhook deliveries
through the real view, real outbox rows and dead letters in PostgreSQL, the real breaker in
Redis, real jobs under their locks, real tasks in real workers, and gunicorn and a prefork
worker sharing their counts across processes."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone
from prometheus_client import REGISTRY

from asyncwork import backend, broker
from asyncwork.contrib.monitoring import metrics
from asyncwork.contrib.periodic import jobs
from asyncwork.deadletters import record, replay
from asyncwork.errors import PermanentError
from asyncwork.models import Job
from asyncwork.settings import asyncwork_settings
from core.celery import app
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import EMAIL_QUEUE, email_breaker, send_invoice_email
from stack import launch, stripe_events
from stack.net import free_port, wait_until
from stack.smtp import SmtpServer
from tests.helpers.metrics import (
    METRICS_URL,
    Samples,
    delta,
    multiprocess_gunicorn,
    parse,
    scrape,
    value,
)
from tests.helpers.processes import worker_env, worker_thread
from tests.helpers.stripe import WEBHOOK_URL, paid_event, post_event, post_signed

SEND_INVOICE_EMAIL = send_invoice_email.module_path


def registry_value(name: str, **labels: str) -> float:
    """A counter as the worker-side signal receivers wrote it, in this process's registry."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def ignored_event() -> dict[str, Any]:
    return stripe_events.event("customer.created", stripe_events.customer_object())


# --- The web process's event counters ----------------------------------------------------------


@pytest.mark.django_db
def test_webhook_deliveries_are_counted_by_outcome(client: Client, settings: Any) -> None:
    # Backpressure measured on every request, soft at one unpublished row: once the payment
    # below is stored (its outbox row unpublished: no commit in this test), ignored types shed.
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_CHECK_SECONDS": 0,
        "BACKPRESSURE_SOFT_MARK": 1,
        "BACKPRESSURE_HARD_MARK": 1000,
    }
    payment = stripe_events.encode(paid_event())
    before = scrape(client)

    statuses = [
        post_event(client, payment).status_code,  # accepted
        post_event(client, payment).status_code,  # duplicate
        post_event(client, stripe_events.encode(ignored_event())).status_code,
        post_event(client, payment, secret="whsec_wrong").status_code,
    ]

    after = scrape(client)
    assert statuses == [200, 200, 503, 400]
    name = "invoicing_webhook_deliveries_total"
    assert delta(before, after, name, outcome="accepted", reason="") == 1
    assert delta(before, after, name, outcome="duplicate", reason="") == 1
    assert delta(before, after, name, outcome="shed", reason="soft") == 1
    assert delta(before, after, name, outcome="rejected", reason="no signature matches") == 1
    assert delta(before, after, name, outcome="unavailable", reason="") == 0


@pytest.mark.django_db(transaction=True)
def test_outbox_publishes_are_timed_and_failures_counted(client: Client) -> None:
    before = scrape(client)
    assert post_event(client, stripe_events.encode(paid_event())).status_code == 200

    # A publish the broker refuses: a thread of its own builds its broker connection anew.
    row = Job.objects.create(task=SEND_INVOICE_EMAIL, args=[0], queue=broker.DLQ)
    published: list[int] = []

    def publish() -> None:
        try:
            published.append(backend.republish(ids=[row.pk], actor="test"))
        finally:
            connection.close()

    app.conf["broker_write_url"] = f"redis://127.0.0.1:{free_port()}/0"
    try:
        thread = threading.Thread(target=publish)
        thread.start()
        thread.join(10)
    finally:
        app.conf["broker_write_url"] = None

    after = scrape(client)
    assert published == [0]
    latency = "invoicing_outbox_publish_latency_seconds"
    assert delta(before, after, f"{latency}_count", queue="email") == 1
    assert 0 <= delta(before, after, f"{latency}_sum", queue="email") < 5
    assert delta(before, after, f"{latency}_bucket", queue="email", le="+Inf") == 1
    assert delta(before, after, "invoicing_outbox_publish_failures_total", queue="dlq") == 1
    assert delta(before, after, f"{latency}_count", queue="dlq") == 0


# --- Scrape-time state ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_state_gauges_are_read_from_the_database_and_redis_at_scrape_time(
    client: Client,
) -> None:
    # Three rows a broker outage left unpublished, two minutes ago.
    rows = Job.objects.bulk_create(
        Job(task=SEND_INVOICE_EMAIL, args=[n], queue=EMAIL_QUEUE) for n in range(3)
    )
    Job.objects.filter(pk__in=[r.pk for r in rows]).update(
        created_at=timezone.now() - timedelta(minutes=2)
    )
    # Two dead letters, one replayed: its job goes back on the email queue.
    letters = [
        record(
            task=SEND_INVOICE_EMAIL,
            task_id=f"metrics-{n}",
            args=[n],
            kwargs={},
            queue=EMAIL_QUEUE,
            reason="permanent",
            exc=PermanentError("nope"),
            traceback="",
            attempts=1,
        )
        for n in (1, 2)
    ]
    assert letters[0] is not None
    assert letters[1] is not None
    assert replay(ids=[letters[0].pk], actor="test").replayed == [letters[0].pk]
    # The email provider's breaker, opened by consecutive failures.
    breaker = email_breaker()
    for _ in range(breaker.threshold):
        breaker.record_failure()
    # Jobs: one run beside a concurrent skip, one failed run; retention never ran.
    holding, release = threading.Event(), threading.Event()

    def held() -> None:
        holding.set()
        release.wait(10)

    def hold() -> None:
        try:
            jobs.job_run(name="stripe-events-reconcile", body=held)
        finally:
            connection.close()

    def fail() -> None:
        raise RuntimeError("boom")

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    assert not jobs.job_run(name="stripe-events-reconcile", body=lambda: None).ran
    release.set()
    holder.join(10)
    with pytest.raises(RuntimeError, match="boom"):
        jobs.job_run(name="dlq-alert", body=fail)
    # Email deliveries: two sent (1 and 3 attempts), one failed (2), one resend sent (1).
    invoice = Invoice.objects.create(
        provider_invoice_id="in_metrics", status="paid", provider_updated_at=timezone.now()
    )
    for key, state, attempts in [
        ("invoice_email_sent:1", "sent", 1),
        ("invoice_email_sent:2", "sent", 3),
        ("invoice_email_sent:3", "failed", 2),
        ("invoice_email_resend:1:abc", "sent", 1),
    ]:
        EmailDelivery.objects.create(
            key=key, invoice=invoice, state=state, attempts=attempts, message_id=f"<{key}@x>"
        )

    samples = scrape(client)

    assert value(samples, "invoicing_outbox_backlog") == 3
    assert 120 <= value(samples, "invoicing_outbox_oldest_unpublished_age_seconds") < 180
    assert value(samples, "invoicing_dlq_depth") == 1
    assert value(samples, "invoicing_broker_queue_depth", queue="email") == 1
    assert value(samples, "invoicing_breaker_state", breaker="email", state="open") == 1
    assert value(samples, "invoicing_breaker_state", breaker="email", state="closed") == 0
    assert value(samples, "invoicing_breaker_consecutive_failures", breaker="email") == 5
    runs, skips = "invoicing_scheduled_job_runs_total", "invoicing_scheduled_job_skips_total"
    assert value(samples, runs, job="stripe-events-reconcile") == 1
    assert value(samples, skips, job="stripe-events-reconcile") == 1
    assert value(samples, runs, job="dlq-alert") == 1
    assert value(samples, skips, job="dlq-alert") == 0
    assert ("invoicing_scheduled_job_runs_total", (("job", "retention-purge"),)) in samples
    assert value(samples, runs, job="retention-purge") == 0
    failed = "invoicing_scheduled_job_last_run_failed"
    assert value(samples, failed, job="dlq-alert") == 1
    assert value(samples, failed, job="stripe-events-reconcile") == 0
    last_run = value(
        samples,
        "invoicing_scheduled_job_last_run_timestamp_seconds",
        job="stripe-events-reconcile",
    )
    assert abs(last_run - time.time()) < 60
    sent = "invoicing_emails_sent_total"
    assert value(samples, sent, kind="invoice_email_sent") == 2
    assert value(samples, sent, kind="invoice_email_resend") == 1
    assert value(samples, "invoicing_email_send_attempts_total", kind="invoice_email_sent") == 6
    assert (
        value(samples, "invoicing_email_deliveries", kind="invoice_email_sent", state="failed") == 1
    )
    for source in ("outbox", "dlq", "scheduled_jobs", "broker_queues", "emails", "email_breaker"):
        assert value(samples, "invoicing_metrics_source_up", source=source) == 1, source


@pytest.mark.django_db(transaction=True)
def test_a_source_that_cannot_answer_is_left_out_and_the_scrape_still_answers(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outbox table locked by another transaction: its query hits the statement timeout,
    the later database sources are skipped, Redis sources still answer; an unreachable broker
    leaves out only the queue depth. Never a 500, never a long wait."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "PROBE_TIMEOUT_SECONDS": 0.3}
    locked, release = threading.Event(), threading.Event()

    def lock_outbox() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("LOCK TABLE asyncwork_job IN ACCESS EXCLUSIVE MODE")
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    locker = threading.Thread(target=lock_outbox)
    locker.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        samples = scrape(client)
        took = time.monotonic() - started
    finally:
        release.set()
        locker.join(10)

    assert took < 3
    up = "invoicing_metrics_source_up"
    assert value(samples, up, source="dlq") == 1  # read before the outbox
    assert value(samples, up, source="outbox") == 0
    assert value(samples, up, source="scheduled_jobs") == 0  # skipped after the database failed
    assert value(samples, up, source="emails") == 0
    assert value(samples, up, source="email_breaker") == 1
    assert value(samples, up, source="broker_queues") == 1
    assert ("invoicing_outbox_backlog", ()) not in samples
    assert value(samples, "invoicing_breaker_state", breaker="email", state="closed") == 1

    # The broker the Celery app reads: its environment variable comes before its settings.
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("CELERY_BROKER_URL", unreachable)
    settings.CELERY_BROKER_URL = unreachable
    samples = scrape(client)
    assert value(samples, up, source="broker_queues") == 0
    assert value(samples, up, source="outbox") == 1
    assert ("invoicing_broker_queue_depth", (("queue", "email"),)) not in samples


@pytest.mark.django_db
def test_who_may_read_metrics(client: Client, settings: Any) -> None:
    # By default, loopback only: not the private ranges a balancer or Docker's gateway is in.
    assert asyncwork_settings.METRICS_ALLOWED_NETWORKS == ["127.0.0.0/8", "::1/128"]
    assert client.get(METRICS_URL, REMOTE_ADDR="127.0.0.5").status_code == 200
    assert client.get(METRICS_URL, REMOTE_ADDR="::1").status_code == 200
    assert client.get(METRICS_URL, REMOTE_ADDR="::ffff:127.0.0.1").status_code == 200
    for outside in ("10.1.2.3", "172.17.0.1", "192.168.1.5", "fd00::1", "203.0.113.7"):
        assert client.get(METRICS_URL, REMOTE_ADDR=outside).status_code == 403, outside
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_ALLOWED_NETWORKS": ["10.0.0.0/8"]}
    assert client.get(METRICS_URL, REMOTE_ADDR="10.1.2.3").status_code == 200
    assert client.get(METRICS_URL, REMOTE_ADDR="::ffff:10.1.2.3").status_code == 200
    assert client.get(METRICS_URL, REMOTE_ADDR="::ffff:203.0.113.7").status_code == 403
    assert client.post(METRICS_URL).status_code == 405
    # Through a proxy the app was not told about: its address says nothing of the client.
    proxied = client.get(METRICS_URL, REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.7")
    assert proxied.status_code == 403
    # From a trusted proxy, the client is the address it appended.
    settings.ASYNCWORK = {**settings.ASYNCWORK, "TRUSTED_PROXIES": ["10.0.0.2"]}
    for client_address, status in (("10.9.9.9", 200), ("203.0.113.7", 403)):
        response = client.get(
            METRICS_URL,
            REMOTE_ADDR="10.0.0.2",
            HTTP_X_FORWARDED_FOR=f"198.51.100.1, {client_address}",
        )
        assert response.status_code == status, client_address
    # A token, when set, is what counts, from anywhere.
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": "s3cret-token"}
    assert client.get(METRICS_URL).status_code == 401
    assert client.get(METRICS_URL, HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    allowed = client.get(
        METRICS_URL, REMOTE_ADDR="203.0.113.7", HTTP_AUTHORIZATION="Bearer s3cret-token"
    )
    assert allowed.status_code == 200
    assert b"invoicing_dlq_depth" in allowed.content


# --- Worker-side counters -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_task_attempts_and_outcomes_are_counted_by_the_worker(
    client: Client, smtp: SmtpServer, settings: Any
) -> None:
    """A retry then a success, a deferral behind the open breaker then a success, and a
    permanent failure, in a real worker; read from the registry the signal receivers write."""
    task = SEND_INVOICE_EMAIL
    attempts = "invoicing_task_attempts_total"
    counters = {
        outcome: registry_value(attempts, task=task, outcome=outcome)
        for outcome in ("successful", "retry", "deferred", "failed")
    }
    starts = registry_value("invoicing_task_starts_total", task=task)
    emails = registry_value("invoicing_worker_emails_sent_total", task=task)

    def grew(outcome: str) -> float:
        return registry_value(attempts, task=task, outcome=outcome) - counters[outcome]

    settings.EMAIL_BREAKER_RESET_SECONDS = 1
    with worker_thread():
        smtp.handler.faults.replies = ["451 4.3.0 try again later"]
        post_event(client, stripe_events.encode(paid_event()))
        assert wait_until(lambda: grew("successful") == 1, timeout=30)
        assert grew("retry") == 1

        breaker = email_breaker()
        for _ in range(breaker.threshold):
            breaker.record_failure()
        post_event(client, stripe_events.encode(paid_event()))
        assert wait_until(lambda: grew("successful") == 2, timeout=30)
        assert grew("deferred") >= 1

        smtp.handler.faults.always = "550 5.7.1 message rejected"
        post_event(client, stripe_events.encode(paid_event()))
        assert wait_until(lambda: grew("failed") == 1, timeout=30)

    assert len(smtp.messages) == 2
    assert grew("retry") == 1
    assert registry_value("invoicing_worker_emails_sent_total", task=task) - emails == 2
    started = registry_value("invoicing_task_starts_total", task=task) - starts
    # Every run started ended in exactly one outcome: 2 successes, 1 retry, 1 failure, and
    # however many deferrals the cool-down took.
    assert started == 4 + grew("deferred")
    assert grew("successful") == 2


def test_worker_metrics_are_not_served_from_a_prefork_worker_without_a_shared_directory(
    settings: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_METRICS_PORT": port}
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with caplog.at_level(logging.ERROR, logger="asyncwork.contrib.monitoring.metrics"):
        metrics._worker_metrics_serve(sender=SimpleNamespace(pool_cls="prefork"))
    assert "PROMETHEUS_MULTIPROC_DIR is not" in caplog.text
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port``, from Linux's /proc."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # Each 32-bit word of the address is printed in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


@pytest.mark.slow
def test_worker_metrics_listen_on_loopback_unless_configured(tmp_path: Path) -> None:
    """Nothing authenticates the worker's metrics port: without WORKER_METRICS_ADDR, a real
    worker serves it on 127.0.0.1 only, not on every interface."""
    port = free_port()
    env = worker_env(0, WORKER_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    env.pop("WORKER_METRICS_ADDR", None)  # the default, whatever this shell exported
    worker = launch.celery_worker(env, name="metrics-bind")
    try:
        worker.wait_ready()
        assert wait_until(lambda: listening_addresses(port), timeout=10), worker.log_text()
        assert listening_addresses(port) == {"127.0.0.1"}
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        worker.stop()
    assert f"worker metrics served on port {port} of 127.0.0.1" in worker.log_text()


# --- Several processes, one count ---------------------------------------------------------------


@pytest.fixture
def gunicorn(transactional_db: None, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """gunicorn with two workers in multiprocess mode, on this test's database and broker."""
    directory = tmp_path / "metrics-web"
    directory.mkdir()
    (directory / "counter_1.db").write_bytes(b"")  # left by an earlier run: must be cleared
    with multiprocess_gunicorn(directory, log=tmp_path / "gunicorn.log") as url:
        yield url, directory


@pytest.mark.slow
def test_gunicorn_workers_counts_are_summed_in_one_scrape(gunicorn: tuple[str, Path]) -> None:
    url, directory = gunicorn
    assert not (directory / "counter_1.db").exists()

    def deliver(_: int) -> int:
        body = stripe_events.encode(paid_event())
        return int(post_signed(f"{url}{WEBHOOK_URL}", body).status_code)

    def writers() -> set[str]:
        return {path.stem.rsplit("_", 1)[-1] for path in directory.glob("counter_*.db")}

    sent = 0
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):  # until both workers took some (the kernel decides who accepts)
            assert set(pool.map(deliver, range(8))) == {200}
            sent += 8
            if len(writers()) >= 2:
                break
    assert len(writers()) == 2

    samples = parse(requests.get(f"{url}{METRICS_URL}", timeout=10).text)

    accepted = ("invoicing_webhook_deliveries_total", (("outcome", "accepted"), ("reason", "")))
    assert samples[accepted] == sent
    # Every on-commit publish is counted once, timed if it went out, as a failure if not.
    published = value(samples, "invoicing_outbox_publish_latency_seconds_count", queue="email")
    failed = value(samples, "invoicing_outbox_publish_failures_total", queue="email")
    assert published + failed == sent
    # Each row sent was marked published by the request that sent it.
    assert Job.objects.filter(published_at__isnull=True).count() == failed


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_prefork_worker_serves_its_childrens_counts(
    client: Client, smtp: SmtpServer, tmp_path: Path
) -> None:
    directory = tmp_path / "metrics-worker"
    directory.mkdir()
    (directory / "counter_1.db").write_bytes(b"")  # left by an earlier run: must be cleared
    port = free_port()
    env = worker_env(
        smtp.port, WORKER_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(directory)
    )
    worker = launch.celery_worker(env, name="metrics", concurrency=2)
    url = f"http://127.0.0.1:{port}/metrics"
    task = SEND_INVOICE_EMAIL

    def scraped() -> Samples:
        return parse(requests.get(url, timeout=5).text)

    def successes() -> float:
        return value(scraped(), "invoicing_task_attempts_total", task=task, outcome="successful")

    try:
        worker.wait_ready()
        for _ in range(4):
            assert post_event(client, stripe_events.encode(paid_event())).status_code == 200
        smtp.handler.wait_for(4, timeout=30)
        assert wait_until(lambda: successes() == 4, timeout=10), worker.log_text()
        samples = scraped()
    finally:
        worker.stop()

    assert value(samples, "invoicing_worker_emails_sent_total", task=task) == 4
    assert value(samples, "invoicing_task_starts_total", task=task) == 4
    assert value(samples, "invoicing_task_attempts_total", task=task, outcome="retry") == 0
    assert "worker metrics served on port" in worker.log_text()
    assert not (directory / "counter_1.db").exists()
