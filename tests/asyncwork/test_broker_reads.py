"""The broker as the probes read it, on whichever broker the run uses (``BOTH_BROKERS``): the
queue depths the dashboard, ``/metrics`` and backpressure show, the ``/health/`` broker check,
and a broker that does not answer (refused, or accepting the connection and saying nothing),
which gives a clear unknown or failing result within the probe timeout, never a 500 or a hang.

On Redis the depth is the length of the queue's lists; on RabbitMQ, the messages ready on the
quorum queue, read by a passive declaration on a kept AMQP connection
(``asyncwork.contrib.backpressure.rabbitmq_depths``)."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from asyncwork.broker import DEFAULT, DLQ, rabbitmq, watched
from asyncwork.contrib import backpressure
from asyncwork.contrib.backpressure import BrokerUnreadable, queues_probe
from asyncwork.contrib.monitoring import health
from asyncwork.contrib.monitoring.gauges import queues_figures
from asyncwork.settings import asyncwork_settings
from core.celery import app
from invoicing.tasks import EMAIL_QUEUE
from stack.net import wait_until
from tests.helpers import broker
from tests.helpers.broker import rabbitmq_only

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "broker-reads-token"


@pytest.fixture(autouse=True)
def _no_shared_report() -> Iterator[None]:
    health._shared = None
    yield
    health._shared = None


@pytest.fixture
def monitor(settings: Any) -> Client:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": TOKEN}
    return Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


@pytest.fixture
def silent_broker() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word (a stalled broker): a read
    must give up at the probe timeout, not wait."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def unreachable_url(port: int) -> str:
    if rabbitmq():
        return f"amqp://guest:guest@127.0.0.1:{port}/nowhere"
    return f"redis://127.0.0.1:{port}/0"


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_the_queues_probe_counts_messages_waiting_on_each_queue() -> None:
    for _ in range(3):
        app.send_task("core.nothing", queue=EMAIL_QUEUE)
    app.send_task("core.nothing", queue=DEFAULT, priority=9)

    assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == 3, timeout=5)
    # On RabbitMQ a job published again goes to its own queue; on Redis to the queue read
    # ahead of it (asyncwork.broker). And dlq is RabbitMQ's alone, where it holds what went
    # past a delivery limit.
    if broker.RABBITMQ:
        ahead: dict[str, int] = {}
        dlq = {DLQ: 0}
    else:
        ahead = {f"{DEFAULT}-recovery": 0, f"{EMAIL_QUEUE}-recovery": 0}
        dlq = {}
    assert queues_probe().depths == {
        DEFAULT: 1,
        **ahead,
        EMAIL_QUEUE: 3,
        **dlq,
    }
    assert queues_probe((EMAIL_QUEUE,)).depths == {EMAIL_QUEUE: 3}


@rabbitmq_only
def test_on_rabbitmq_the_probe_also_counts_consumers_and_the_dashboard_shows_them() -> None:
    app.send_task("core.nothing", queue=EMAIL_QUEUE)
    probe = queues_probe()
    assert probe.consumers is not None
    assert probe.consumers[EMAIL_QUEUE] == 0  # no worker in this test
    shown = {figure.label: figure for figure in queues_figures(probe)}
    assert shown[f"waiting on {EMAIL_QUEUE}"].value == "1"
    assert shown[f"consumers of {EMAIL_QUEUE}"].status == "degraded"
    assert f"consumers of {DLQ}" not in shown


def test_a_depth_read_is_cheap() -> None:
    """The figure the report quotes: the cost of one read of every queue on a warm client."""
    names = watched()
    queues_probe(names)  # connect
    costs = []
    for _ in range(50):
        started = time.perf_counter()
        queues_probe(names)
        costs.append((time.perf_counter() - started) * 1000)
    median = statistics.median(costs)
    print(f"\nreading {len(names)} queues: median {median:.2f} ms, max {max(costs):.2f} ms")
    assert median < 20


def test_backpressure_sheds_on_a_deep_queue(settings: Any) -> None:
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_SOFT_MARK": 4,
        "BACKPRESSURE_HARD_MARK": 100,
    }
    assert backpressure.pressure_measure().queue_depth == 0
    for _ in range(5):
        app.send_task("core.nothing", queue=EMAIL_QUEUE)
    assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == 5, timeout=5)
    pressure = backpressure.pressure_measure()
    assert pressure.queue_depth == 5
    assert pressure.level() is backpressure.Level.SOFT


def test_the_health_report_reads_the_broker(monitor: Client) -> None:
    for _ in range(2):
        app.send_task("core.nothing", queue=EMAIL_QUEUE)
    assert wait_until(lambda: broker.queue_depth(EMAIL_QUEUE) == 2, timeout=5)
    response = monitor.get("/health/")
    body = response.json()
    assert body["checks"]["broker"]["status"] == "ok", body
    assert body["checks"]["backpressure"]["queue_depth"] == 2, body


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_a_broker_that_does_not_answer_is_unknown_or_failing_fast(
    monitor: Client, monkeypatch: pytest.MonkeyPatch, silent_broker: int, kind: str
) -> None:
    port = silent_broker if kind == "silent" else refused_port()
    # The probes read the Celery app's broker, whose URL Celery takes from CELERY_BROKER_URL in
    # the environment (which this run sets, tests/settings.py) before its configuration.
    monkeypatch.setenv("CELERY_BROKER_URL", unreachable_url(port))
    assert app.conf.broker_url == unreachable_url(port)
    limit = asyncwork_settings.PROBE_TIMEOUT_SECONDS * 2 + 1

    started = time.monotonic()
    with pytest.raises(BrokerUnreadable):
        queues_probe()
    assert time.monotonic() - started < limit

    started = time.monotonic()
    pressure = backpressure.pressure_measure()
    assert pressure.queue_depth is None  # unknown: sheds nothing on its account
    assert time.monotonic() - started < limit

    started = time.monotonic()
    response = monitor.get("/health/")
    assert time.monotonic() - started < asyncwork_settings.HEALTH_TIMEOUT_SECONDS + 1
    assert response.status_code == 503
    body = response.json()
    assert "broker" in body["failing"], body
    assert body["checks"]["backpressure"]["queue_depth"] is None

    # The answer is a clear one, and the broker back is read again (a new connection).
    monkeypatch.undo()
    assert queues_probe((EMAIL_QUEUE,)).depths == {EMAIL_QUEUE: 0}
