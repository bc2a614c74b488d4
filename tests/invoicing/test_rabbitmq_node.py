"""The pipeline on RabbitMQ when the broker restarts or stalls, and RabbitMQ's consumer timeout,
each on a RabbitMQ node of the test's own (``stack.rabbitmq.RabbitNode``): the machine's node is
shared and never stopped or paused. The node is the test's, so these run in the Redis stage
(no virtual host of the run's is needed).

How work reaches the node. This test process's Celery app is set up for the run's broker
(Redis here: its queue declarations, transport options), so it cannot publish as a process
configured for RabbitMQ does. The test enqueues its jobs due now (``run_after``), which this
process does not publish; the relay of a process on the node's environment publishes them: a
worker's poll, or, where no worker may run yet, the relay run once in a ``manage.py shell`` of
its own. Either way the application's own publish path (quorum queue declarations, publisher
confirms) from a process configured for RabbitMQ from the start, and nothing in this process
to repoint and restore. The workers' ``CELERY_BROKER_URL`` is the node's; the cache and the
breaker stay on the run's Redis (``REDIS_URL``), the database is the run's test database.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import cache
from django.utils import timezone
from kombu import Connection

from asyncwork.models import DeadLetter, Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.process import ROOT
from stack.rabbitmq import RabbitNode
from stack.smtp import SmtpServer
from tests import tasks as test_tasks
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env
from tests.tasks import FLAKY_RETRY_SECONDS, flaky

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONSUMER_TIMEOUT_MS = 5000
# How often a channel checks its consumers' timeouts (the rabbit application's
# channel_tick_interval): every 60 s by default on 3.10.8, so a 5 s timeout would fire up to a
# minute late and the test would have to hold for over a minute twice. Lowered on the
# consumer-timeout test's node instead (at run time, before any client connects), as
# RabbitMQ's own consumer-timeout suite does; the timeout itself is the one configured.
TICK_MS = 500
LOG_SEEN_WITHIN = 0.25  # seconds: a worker's log line, seen by polling it
TIMED_OUT = "delivery acknowledgement on channel"  # RabbitMQ's reason, in the worker's log
NODE_TIMED_OUT = "has timed out waiting for delivery acknowledgement"  # in the node's log
SKIPPED = "'skipped'"  # what Celery logs of a run that found its job taken or done


@pytest.fixture
def rabbit(tmp_path: Path) -> Iterator[Callable[..., RabbitNode]]:
    """Starts a RabbitMQ node of this test's own (``config``: rabbitmq.conf lines); removes
    every node it started when the test ends, failed or not. The node's log stays in the
    test's tmp_path."""
    nodes: list[RabbitNode] = []

    def start(**config: str) -> RabbitNode:
        node = RabbitNode(config=config, log_dir=tmp_path)
        nodes.append(node)
        return node.start()

    yield start
    for node in nodes:
        node.remove()


def _env(smtp: SmtpServer, node: RabbitNode) -> dict[str, str]:
    return worker_env(smtp.port, CELERY_BROKER_URL=node.url)


_RELAY = (
    "from datetime import timedelta; from asyncwork.backend import relay; "
    "print('published', relay(grace=timedelta(0)))"
)


def _relay(env: dict[str, str]) -> int:
    """The relay every worker's poll runs, run once in a process of its own on ``env``'s
    broker; how many jobs it published."""
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", _RELAY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout.split()[-1])  # "published N"


def _due_now(task: Any, *args: object) -> int:
    """Enqueue ``task(*args)`` due now: no publish in this process, the relay of one on the node
    publishes it (above); its job's id."""
    return int(task.using(run_after=timezone.now()).enqueue(*args).id)


def _emails_waiting(count: int) -> list[Invoice]:
    """``count`` paid invoices, each with its email's job, unpublished."""
    invoices = [paid_invoice() for _ in range(count)]
    for invoice in invoices:
        _due_now(send_invoice_email, invoice.pk)
    return invoices


def _node_queues(node: RabbitNode) -> dict[str, dict[str, Any]]:
    """The node's queues by name: type, durability, messages ready and unacknowledged."""
    columns = ("name", "type", "durable", "messages_ready", "messages_unacknowledged")
    out = node.ctl("list_queues", "-q", "--formatter", "json", *columns)
    return {row["name"]: row for row in json.loads(out or "[]")}


def _depth(node: RabbitNode, queue: str) -> int:
    """Messages ready on ``queue`` of ``node``, as the queue itself counts them (a passive
    declare; rabbitmqctl reports a quorum queue's counts as of its last metrics tick)."""
    with Connection(node.url, connect_timeout=5) as conn:
        channel: Any = conn.default_channel
        return int(channel.queue_declare(queue, passive=True).message_count)


def _channels(node: RabbitNode) -> list[dict[str, Any]]:
    """The node's channels: each one's consumers and the messages it holds unacknowledged, as
    the channel itself counts them now."""
    columns = ("connection", "number", "consumer_count", "messages_unacknowledged")
    out = node.ctl("list_channels", "-q", "--formatter", "json", *columns)
    return list(json.loads(out or "[]"))


def _held(node: RabbitNode) -> int:
    return sum(int(channel["messages_unacknowledged"]) for channel in _channels(node))


def _drained(node: RabbitNode, queue: str) -> bool:
    """Nothing waits on ``queue`` of ``node`` and no channel holds a message (the last
    acknowledgement follows its email's being marked sent: a moment to arrive)."""
    return bool(wait_until(lambda: _depth(node, queue) == 0 and _held(node) == 0, timeout=10))


def _node_log(node: RabbitNode) -> str:
    assert node.process is not None
    return node.process.log_text()


def _published() -> bool:
    return not Job.objects.filter(published_at__isnull=True).exists()


def _sent() -> int:
    return EmailDelivery.objects.filter(state="sent").count()


def _exactly_once(smtp: SmtpServer, invoices: list[Invoice]) -> None:
    """Every invoice's email was sent once, and no other message. Called once the node was
    drained (``_drained``) and the workers stopped: nothing is left to bring a duplicate."""
    deliveries = {d.invoice_id: d for d in EmailDelivery.objects.all()}
    assert {d.state for d in deliveries.values()} == {"sent"}
    assert set(deliveries) == {invoice.pk for invoice in invoices}
    sent_ids = sorted(str(m["Message-ID"]) for m in smtp.messages)
    assert sent_ids == sorted(d.message_id for d in deliveries.values())
    assert not DeadLetter.objects.exists()


def _connections(log: str) -> int:
    """How many times a worker connected to the broker, by its log."""
    return log.count("Connected to amqp://")


def test_emails_queued_on_the_node_survive_its_restart_and_are_sent_once(
    smtp: SmtpServer, rabbit: Callable[..., RabbitNode], tmp_path: Path
) -> None:
    """Published with no worker running, then the node stops cleanly and starts on its data:
    durable quorum queues and persistent messages come back, and a worker sends each email
    once."""
    node = rabbit()
    env = _env(smtp, node)
    invoices = _emails_waiting(20)
    assert _relay(env) == 20
    assert _depth(node, "email") == 20
    email = _node_queues(node)["email"]
    assert (email["type"], email["durable"]) == ("quorum", True)
    stopping = time.monotonic()
    node.stop()
    node.start()
    restarted = time.monotonic()
    assert _depth(node, "email") == 20

    with launch.celery_worker(
        env, name="after-restart", concurrency=2, log=tmp_path / "worker.log"
    ) as worker:
        assert wait_until(lambda: _sent() == 20, timeout=60), worker.log_tail()
        sent = time.monotonic()
        assert _drained(node, "email")
    _exactly_once(smtp, invoices)
    print(
        f"restart (stop and start) {restarted - stopping:.1f} s; worker started and sent all "
        f"{sent - restarted:.1f} s after"
    )


def test_a_worker_consuming_through_a_node_restart_sends_every_email_once(
    smtp: SmtpServer, rabbit: Callable[..., RabbitNode], tmp_path: Path
) -> None:
    """The node stops cleanly while a worker is sending (and holds messages unacknowledged)
    and starts again a few seconds later: the worker reconnects and consumes again, the
    messages it held come back, and their redeliveries find their jobs taken or done."""
    node = rabbit()
    env = _env(smtp, node)
    invoices = _emails_waiting(20)
    smtp.handler.faults.delay = 0.5  # each email takes half a second: a restart lands mid-run
    with launch.celery_worker(
        env, name="through-restart", concurrency=2, log=tmp_path / "worker.log"
    ) as worker:
        assert wait_until(_published, timeout=10), worker.log_tail()  # by the worker's poll
        assert wait_until(lambda: _sent() >= 5, timeout=30), worker.log_tail()
        stopped = time.monotonic()
        node.stop()
        sent_while_down = _sent()
        node.start()
        restarted = time.monotonic()
        assert wait_until(lambda: _sent() == 20, timeout=60), worker.log_tail()
        done = time.monotonic()
        assert _drained(node, "email")
        log = worker.log_text()
    _exactly_once(smtp, invoices)
    assert _connections(log) == 2, log[-3000:]  # the first connection, and after the restart
    # It consumed again: once the two it held (prefetch 1 x 2 processes) had finished, the
    # emails left were sent after it reconnected.
    after_reconnect = log.rpartition("Connected to amqp://")[2]
    assert sent_while_down + 2 < 20
    assert after_reconnect.count("invoice email sent") >= 20 - sent_while_down - 2
    print(
        f"node down {restarted - stopped:.1f} s; {sent_while_down} sent before the stop; "
        f"all sent {done - restarted:.1f} s after the start; "
        f"{log.count(SKIPPED)} redelivery(ies) found their job taken or done"
    )


def test_a_node_stalled_for_ten_seconds_leaves_no_worker_idle(
    smtp: SmtpServer, rabbit: Callable[..., RabbitNode], tmp_path: Path
) -> None:
    """The whole node is stopped (SIGSTOP) for 10 s while two workers work through a backlog:
    their connections stay open and nothing answers. Once it resumes, both take work again
    and every email is sent once."""
    node = rabbit()
    env = _env(smtp, node)
    invoices = _emails_waiting(30)
    smtp.handler.faults.delay = 0.3
    workers = [
        launch.celery_worker(env, name=f"stall-{n}", log=tmp_path / f"worker-{n}.log")
        for n in (1, 2)
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        assert wait_until(_published, timeout=10)  # by the workers' polls
        assert wait_until(lambda: _sent() >= 4, timeout=30)
        node.pause()
        try:
            time.sleep(10)
        finally:
            node.resume()
        resumed = time.monotonic()
        logged = [len(worker.log_text()) for worker in workers]
        sent_at_resume = _sent()
        assert wait_until(lambda: _sent() == 30, timeout=60), [w.log_tail() for w in workers]
        last = time.monotonic() - resumed
        # Nothing left in the queue, nor held by a worker.
        drained = _drained(node, "email")
        after = [worker.log_text()[offset:] for worker, offset in zip(workers, logged, strict=True)]
    finally:
        for worker in workers:
            worker.stop()
    assert drained
    _exactly_once(smtp, invoices)
    # Both workers ran tasks after the stall: neither was left connected and idle.
    assert all("succeeded in" in text for text in after), after
    # On the connections they had: the stall broke none.
    assert [_connections(worker.log_text()) for worker in workers] == [1, 1]
    print(f"{sent_at_resume} sent at the resume; the last email {last:.1f} s after it")


def test_a_retry_waits_past_the_consumer_timeout_with_its_channel_open(
    smtp: SmtpServer, rabbit: Callable[..., RabbitNode], tmp_path: Path
) -> None:
    """On a node whose consumer timeout is 5 s, a job's retry waits 8 s: it waits as its job's
    row (due later), with its first attempt's message acknowledged, so the timeout has nothing
    to cut and the retry runs on the same connection. The control, on the same node and worker:
    a job that keeps its message unacknowledged longer than the timeout has its channel closed
    (PRECONDITION_FAILED, which Celery takes for an unrecoverable error), and its message,
    returned to its queue, reaches the next worker, which finds the job as its run left it and
    runs its body no more often than it was claimed."""
    node = rabbit(consumer_timeout=str(CONSUMER_TIMEOUT_MS))
    node.ctl("eval", f"application:set_env(rabbit, channel_tick_interval, {TICK_MS}).")
    env = _env(smtp, node)
    assert FLAKY_RETRY_SECONDS * 1000 > CONSUMER_TIMEOUT_MS + 2 * TICK_MS
    retried_key, hold_key = f"retried-{uuid.uuid4().hex}", f"hold-{uuid.uuid4().hex}"
    again = None
    worker = launch.celery_worker(
        env, name="timeout", include=("tests.tasks",), log=tmp_path / "worker.log"
    )
    try:
        worker.wait_ready()
        started = time.monotonic()
        retried_id = _due_now(flaky, retried_key)
        # The worker's own poll publishes the job; its first attempt fails and is retried.
        assert wait_until(
            lambda: Job.objects.filter(pk=retried_id, status="READY", attempts=1).exists(),
            timeout=15,
        ), worker.log_tail()
        # While the retry waits, nothing is held unacknowledged on the node.
        time.sleep(CONSUMER_TIMEOUT_MS / 1000 + 1)
        waiting = _channels(node)
        assert wait_until(lambda: cache.get(retried_key) == 2, timeout=20), worker.log_tail()
        retried_after = time.monotonic() - started
        retry_log, node_log = worker.log_text(), _node_log(node)

        # The control: the same node's timeout, live.
        hold_seconds = (CONSUMER_TIMEOUT_MS + 4 * TICK_MS) / 1000 + 2
        hold_id = _due_now(test_tasks.hold, hold_key, hold_seconds)
        received_line = f"[job-{hold_id}] received"
        assert wait_until(lambda: received_line in worker.log_text(), timeout=15)
        received = time.monotonic()
        assert wait_until(lambda: TIMED_OUT in worker.log_text(), timeout=hold_seconds + 5), (
            worker.log_tail()
        )
        cut_after = time.monotonic() - received
        # Celery takes the closed channel for an unrecoverable error (celery/celery#6760): the
        # worker finishes the task it runs and exits, for its supervisor to start it again. (Once
        # in nine runs it hung instead, connected to nothing; its supervisor's stop ends it.)
        exited = wait_until(lambda: not worker.alive(), timeout=hold_seconds + 10)
        worker.stop()
        # The message was never acknowledged: RabbitMQ returned it to its queue.
        back = _depth(node, test_tasks.hold.queue_name)
        again = launch.celery_worker(
            env, name="restarted", include=("tests.tasks",), log=tmp_path / "restarted.log"
        )
        again.wait_ready()
        assert wait_until(lambda: received_line in again.log_text(), timeout=20), again.log_tail()
        assert wait_until(lambda: Job.objects.get(pk=hold_id).status == "SUCCESSFUL", timeout=30), (
            again.log_tail()
        )
        assert wait_until(lambda: _depth(node, test_tasks.hold.queue_name) == 0, timeout=10)
        hold_job = Job.objects.get(pk=hold_id)
        control_log, control_node_log = worker.log_text(), _node_log(node)
    finally:
        worker.stop()
        if again is not None:
            again.stop()
    # The worker's channels consume, and hold nothing.
    assert sum(int(channel["consumer_count"]) for channel in waiting) >= 1, waiting
    assert sum(int(channel["messages_unacknowledged"]) for channel in waiting) == 0, waiting
    assert retried_after >= FLAKY_RETRY_SECONDS - 1
    assert "PRECONDITION_FAILED" not in retry_log
    assert TIMED_OUT not in retry_log
    assert NODE_TIMED_OUT not in node_log
    assert _connections(retry_log) == 1  # the retry ran on the worker's first connection
    assert "Unrecoverable error: PreconditionFailed" in control_log
    assert NODE_TIMED_OUT in control_node_log
    assert back == 1
    # Its first run finished before that worker exited: the message back found the job done
    # (had the run been cut short, the rescue would have run it again, a second claim).
    assert cache.get(hold_key) == hold_job.attempts
    # Both lines are seen by polling the worker's log every 0.1 s, on a busy machine later still:
    # a receipt seen later than the cut shortens the interval seen below the timeout, though
    # never by a second.
    assert CONSUMER_TIMEOUT_MS / 1000 - LOG_SEEN_WITHIN <= cut_after < hold_seconds
    assert not DeadLetter.objects.exists()
    print(
        f"retry ran {retried_after:.1f} s after the first attempt, its channel open; the "
        f"control's channel closed {cut_after:.1f} s after its delivery; the worker "
        + ("exited by itself" if exited else f"did not exit by itself (log: {worker.log})")
    )


_COMMIT_TWICE = """
import sys
import time
import django
django.setup()
from django.db import transaction
from tests.tasks import pid
with transaction.atomic():
    pid.enqueue("warm")
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
with transaction.atomic():
    result = pid.enqueue("stalled")
print(result.id, round(time.monotonic() - started, 3), flush=True)
"""


def test_a_commit_while_the_node_is_stalled_is_not_held_by_the_publish(
    rabbit: Callable[..., RabbitNode], smtp: SmtpServer
) -> None:
    """The on-commit publish is bounded by ``OUTBOX_PUBLISH_TIMEOUT`` (0.5 s) on RabbitMQ too:
    on a connection already open (a web process's), a node that answers nothing (stopped with
    SIGSTOP) costs the request that commits at most that, and the row is left to the relay.
    (Without the AMQP transport's own timeouts, the publish waited for the node's confirm.)"""
    node = rabbit()
    env = _env(smtp, node)
    with subprocess.Popen(
        [sys.executable, "-c", _COMMIT_TWICE],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as web:
        assert web.stdout is not None
        assert web.stdin is not None
        try:
            assert web.stdout.readline().strip() == "ready"
            node.pause()
            web.stdin.write("go\n")
            web.stdin.flush()
            # Bounded here too: without its timeouts the publish waited as long as the stall.
            answered, _, _ = select.select([web.stdout], [], [], 10)
            assert answered, "the commit was held by the stalled node for 10 s"
            pk, seconds = web.stdout.readline().split()
        finally:
            node.resume()
            web.kill()
    print(f"\ncommit with the node stalled: {seconds} s")
    assert float(seconds) < 1.5  # the write, then the confirm, each within 0.5 s
    row = Job.objects.get(pk=int(pk))
    assert row.published_at is None  # left to the relay
    assert _relay(env) == 1
