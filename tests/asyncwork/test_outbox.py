"""The outbox: a stalled broker never fails or hangs the request, the relay publishes what was
left behind, and concurrent relays never publish one row twice."""

from __future__ import annotations

import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from asyncwork import outbox
from asyncwork.models import OutboxMessage
from asyncwork.outbox import _producer_drop, outbox_marks_flush, outbox_relay, outbox_task_id
from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST, wait_until
from stack.process import Process
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import worker_env, worker_thread
from tests.helpers.redis_server import PrivateRedis
from tests.helpers.stripe import WEBHOOK_URL, paid_event, post_event, post_signed
from webhooks import testing as stripe_testing

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def stallable_broker(private_redis: PrivateRedis, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The broker is a Redis of this test's own, which it may stall: the machine's is shared.
    Publishes (this thread's kept outbox connection) and the worker go there."""
    from core.celery import app

    # Celery reads the environment's CELERY_BROKER_URL before its own setting.
    monkeypatch.setenv("CELERY_BROKER_URL", private_redis.url)
    monkeypatch.setattr(app.conf, "broker_url", private_redis.url)
    _producer_drop()
    yield private_redis.client()
    _producer_drop()


@broker.redis_only  # a shared RabbitMQ node cannot be stalled for one test
def test_stalled_broker_at_commit_leaves_the_row_for_the_relay(
    client: Client, smtp: SmtpServer, stallable_broker: redis.Redis
) -> None:
    body = stripe_testing.encode(paid_event())
    stallable_broker.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # the broker stalls
    started = time.monotonic()
    response = post_event(client, body)
    elapsed = time.monotonic() - started

    assert response.status_code == 200
    assert elapsed < settings.OUTBOX_PUBLISH_TIMEOUT + 1.0
    row = OutboxMessage.objects.get()
    assert row.published_at is None
    assert row.publish_attempts == 1
    assert "imeout" in row.last_error

    time.sleep(2.6)  # the stall ends
    with worker_thread():
        call_command("outbox", "relay", "--grace", "0")
        smtp.handler.wait_for(1, timeout=20)
        time.sleep(1)
    row.refresh_from_db()
    assert row.published_at is not None
    assert len(smtp.messages) == 1


def test_a_relay_killed_between_publish_and_mark_publishes_again_and_one_email_is_sent(
    client: Client, smtp: SmtpServer
) -> None:
    from core.celery import app

    with worker_thread():
        post_event(client, stripe_testing.encode(paid_event()))
        smtp.handler.wait_for(1, timeout=20)
        # The state a crash after publishing but before committing "published" leaves behind:
        # the message went out, the row is still unpublished.
        assert outbox_marks_flush()
        row = OutboxMessage.objects.get()
        OutboxMessage.objects.filter(pk=row.pk).update(published_at=None)
        app.send_task(
            row.task,
            args=row.args,
            kwargs={"outbox_id": row.pk},
            task_id=outbox_task_id(row.pk),
            queue=row.queue,
        )
        assert outbox_relay() == 1
        time.sleep(2)
    assert len(smtp.messages) == 1


def test_concurrent_relays_publish_each_row_exactly_once() -> None:
    queue = f"relaytest-{uuid.uuid4().hex[:8]}"
    OutboxMessage.objects.bulk_create(
        OutboxMessage(task="core.does_not_exist", args=[i], queue=queue) for i in range(300)
    )
    barrier = threading.Barrier(4)
    totals: list[int] = []

    def relay() -> None:
        try:
            barrier.wait()
            totals.append(outbox_relay(batch_size=25))
        finally:
            connection.close()

    threads = [threading.Thread(target=relay) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    task_ids = [m["headers"]["id"] for m in broker.queue_messages(queue)]
    broker.queue_delete(queue)
    assert sum(totals) == 300
    assert len(task_ids) == 300
    assert len(set(task_ids)) == 300
    assert not OutboxMessage.objects.filter(published_at__isnull=True).exists()


def test_relay_leaves_young_rows_to_their_own_publish() -> None:
    OutboxMessage.objects.create(task="core.does_not_exist", args=[1], queue="relaytest-young")
    assert outbox_relay(grace=timedelta(seconds=60)) == 0
    assert OutboxMessage.objects.get().published_at is None


def test_outbox_command_reports_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from django.core.management.base import CommandError

    call_command("outbox", "status")
    assert "unpublished: 0" in capsys.readouterr().out
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        call_command("outbox", "relay", "--batch-size", "0")


# --- The marks of on-commit publishes (the marker) --------------------------------------------

# A process that publishes three rows on commit, prints their ids, and waits for its stdin to
# close ("wait") or exits at once ("exit").
PUBLISHER = """
import sys

import django

django.setup()
from django.db import transaction

from asyncwork.outbox import outbox_enqueue

for i in range(3):
    with transaction.atomic():
        row = outbox_enqueue(task="core.does_not_exist", args=[i], queue=sys.argv[1])
    print(row.pk, flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()
"""


def publisher(queue: str, then: str, **env: str) -> tuple[Process, list[int]]:
    """``PUBLISHER`` in a process of its own, on this test's database and broker, once it has
    published its three rows; their ids."""
    process = Process(
        [sys.executable, "-c", PUBLISHER, queue, then],
        name="publisher",
        env=worker_env(0, **env),
        pipes=True,
    )
    ids = [int(process.stdout.readline()) for _ in range(3)]
    return process, ids


def test_marks_are_written_off_the_request_in_one_statement_within_the_interval(
    client: Client, settings: Any
) -> None:
    settings.OUTBOX_MARK_SECONDS = 2.0  # the five requests fit in one interval
    statements: list[str] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql.split()[0])
        return execute(sql, params, many, context)

    started = time.monotonic()
    with connection.execute_wrapper(spy):
        for _ in range(5):
            assert post_event(client, stripe_testing.encode(paid_event())).status_code == 200
    assert "UPDATE" not in statements  # no request marked its row
    assert wait_until(
        lambda: not OutboxMessage.objects.filter(published_at__isnull=True).exists(), timeout=5
    )
    # Within the interval, give or take a shared machine's scheduling.
    assert time.monotonic() - started < 2.0 + 1.5
    rows = OutboxMessage.objects.all()
    # One statement's now(): the five marks were one batch.
    assert len({row.published_at for row in rows}) == 1
    assert {row.publish_attempts for row in rows} == {1}


def test_a_process_killed_before_its_marks_are_written_leaves_its_rows_to_the_relay() -> None:
    queue = f"relaytest-{uuid.uuid4().hex[:8]}"
    # An interval far longer than the test: only an exit could write the marks.
    process, ids = publisher(queue, "wait", OUTBOX_MARK_SECONDS="60")
    try:
        assert wait_until(lambda: len(broker.queue_messages(queue)) == 3, timeout=10)
    finally:
        process.kill()  # SIGKILL: no exit handler runs
    assert process.returncode == -signal.SIGKILL
    rows = OutboxMessage.objects.filter(pk__in=ids)
    assert [(row.published_at, row.publish_attempts) for row in rows] == [(None, 0)] * 3

    assert outbox_relay() == 3  # published again: the same messages, twice each
    task_ids = [m["headers"]["id"] for m in broker.queue_messages(queue)]
    broker.queue_delete(queue)
    assert sorted(task_ids) == sorted([outbox_task_id(pk) for pk in ids] * 2)
    assert not OutboxMessage.objects.filter(published_at__isnull=True).exists()


def test_a_process_that_exits_writes_its_pending_marks() -> None:
    queue = f"relaytest-{uuid.uuid4().hex[:8]}"
    process, ids = publisher(queue, "exit", OUTBOX_MARK_SECONDS="60")
    try:
        assert process.popen.wait(30) == 0
    finally:
        process.stop()
    broker.queue_delete(queue)
    rows = OutboxMessage.objects.filter(pk__in=ids)
    assert all(row.published_at is not None for row in rows)
    assert {row.publish_attempts for row in rows} == {1}


def test_a_gunicorn_worker_that_stops_writes_its_pending_marks(tmp_path: Path) -> None:
    with launch.gunicorn(
        worker_env(0, OUTBOX_MARK_SECONDS="60"),
        args=("-c", "python:core.gunicorn_conf", "core.wsgi"),
        config=GunicornConfig(workers=1),
        log=tmp_path / "gunicorn.log",
    ) as server:
        url = f"http://{HOST}:{server.port}{WEBHOOK_URL}"
        assert post_signed(url, stripe_testing.encode(paid_event())).status_code == 200
        assert OutboxMessage.objects.get().published_at is None  # pending, for a minute
        server.stop()  # SIGTERM: the worker finishes and exits
    assert OutboxMessage.objects.get().published_at is not None


# Fails every mark (an UPDATE that sets published_at) while it exists.
REFUSE_MARKS = """
CREATE FUNCTION outbox_marks_refused() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'marks refused by the test'; END $$;
CREATE TRIGGER outbox_marks_refused BEFORE UPDATE OF published_at ON asyncwork_outboxmessage
FOR EACH ROW EXECUTE FUNCTION outbox_marks_refused();
"""
ALLOW_MARKS = """
DROP TRIGGER IF EXISTS outbox_marks_refused ON asyncwork_outboxmessage;
DROP FUNCTION IF EXISTS outbox_marks_refused();
"""


def test_a_failing_database_fails_no_request_and_the_marks_are_written_once_it_recovers(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(REFUSE_MARKS)
    try:
        for _ in range(3):
            assert post_event(client, stripe_testing.encode(paid_event())).status_code == 200
        assert not outbox_marks_flush(timeout=1)  # tried, refused, kept
        assert OutboxMessage.objects.filter(published_at__isnull=True).count() == 3
        assert "outbox marks failed" in caplog.text
    finally:
        with connection.cursor() as cursor:
            cursor.execute(ALLOW_MARKS)
    assert outbox_marks_flush(timeout=10)  # tried again
    assert not OutboxMessage.objects.filter(published_at__isnull=True).exists()
    assert {row.publish_attempts for row in OutboxMessage.objects.all()} == {1}


def test_a_marker_that_falls_behind_leaves_the_request_to_mark_its_own_row(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its bound reached (marks pending or being written), the next request marks its row on
    its own connection; the marker writes the rest once the database lets it."""

    settings.OUTBOX_MARK_SECONDS = 60  # the marker writes when told to (a flush), not before
    monkeypatch.setattr(outbox, "MARK_PENDING_MAX", 2)
    assert post_event(client, stripe_testing.encode(paid_event())).status_code == 200
    first = OutboxMessage.objects.get()
    # Another session holds the first row: the marker's write of it waits (being written: 1).
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"], autocommit=False
    ) as holder:
        holder.execute("SELECT 1 FROM asyncwork_outboxmessage WHERE id = %s FOR UPDATE", [first.pk])
        assert not outbox_marks_flush(timeout=0)  # the write starts, and waits for the lock
        assert wait_until(lambda: outbox._markers["marker"].writing == 1, timeout=10)
        for _ in range(2):  # pending: 1, then full
            assert post_event(client, stripe_testing.encode(paid_event())).status_code == 200
        unmarked = set(
            OutboxMessage.objects.filter(published_at__isnull=True).values_list("pk", flat=True)
        )
        assert len(unmarked) == 2  # the first (held) and the second (pending)
        assert first.pk in unmarked
        holder.rollback()
    assert outbox_marks_flush(timeout=10)
    assert not OutboxMessage.objects.filter(published_at__isnull=True).exists()


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


def test_a_mark_reads_its_rows_by_key_however_many_rows_the_partial_index_holds() -> None:
    """A batch of marks looks its rows up by primary key, so its cost does not grow with the
    entries of the index of unpublished rows: rows marked since the last vacuum (every on-commit
    publish leaves one) and rows left unpublished (a broker outage's backlog). A condition on
    ``published_at`` let PostgreSQL choose that index instead, and read every entry of it for
    each batch of marks, once its statistics said it was small."""
    table = OutboxMessage._meta.db_table
    OutboxMessage.objects.bulk_create(
        OutboxMessage(task="core.does_not_exist", args=[i], queue="relaytest-marks")
        for i in range(3000)
    )
    with connection.cursor() as cursor:
        # The 3,000 rows marked and analysed, their entries left in the index (no vacuum).
        cursor.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        try:
            cursor.execute(f"UPDATE {table} SET published_at = now()")
            cursor.execute(f"ANALYZE {table}")
            rows = OutboxMessage.objects.bulk_create(
                OutboxMessage(task="core.does_not_exist", args=[i], queue="relaytest-marks")
                for i in range(10)
            )
            ids = [row.pk for row in rows]
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {outbox._MARK_PUBLISHED}", [ids])
            plan = cursor.fetchone()[0][0]["Plan"]
        finally:
            cursor.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
    scans = [node for node in _plan_nodes(plan) if "Scan" in node["Node Type"]]
    assert scans
    read = [(node["Node Type"], node.get("Index Name"), node["Actual Rows"]) for node in scans]
    assert all(index != "outbox_unpublished_idx" for _, index, _ in read), read
    # Each scan read about the ten rows, not the index's 3,000 entries.
    assert max(actual for _, _, actual in read) <= 2 * len(ids), read
    marked = OutboxMessage.objects.filter(pk__in=ids)
    assert {(row.published_at is not None, row.publish_attempts) for row in marked} == {(True, 1)}


def test_a_mark_leaves_a_row_marked_meanwhile_as_it_was() -> None:
    """A row the relay (or an operator's republish) marked before this process's marker got to
    it keeps its mark: its time and its count of publishes."""
    row = OutboxMessage.objects.create(task="core.does_not_exist", args=[1], queue="relaytest-x")
    OutboxMessage.objects.filter(pk=row.pk).update(
        published_at=timezone.now() - timedelta(minutes=1), publish_attempts=1
    )
    before = OutboxMessage.objects.get(pk=row.pk)
    outbox._mark_here([row.pk])
    after = OutboxMessage.objects.get(pk=row.pk)
    assert (after.published_at, after.publish_attempts) == (before.published_at, 1)
