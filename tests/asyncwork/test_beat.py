"""One active beat: two ``celery -A core beat`` processes, one dispatches; kill it and the
standby takes over within STANDBY_POLL_SECONDS."""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from io import StringIO

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from asyncwork.contrib.monitoring.gauges import beat_check
from asyncwork.contrib.periodic import beat as beat_module
from asyncwork.contrib.periodic.beat import STANDBY_POLL_SECONDS, active_beat
from asyncwork.contrib.periodic.jobs import jobs_declared
from asyncwork.contrib.periodic.locks import Holder
from stack import launch
from stack.net import free_port, wait_until
from stack.process import Process
from tests.helpers.processes import worker_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

INTERVAL = 2  # seconds between slots of the probe task


def start_beat(name: str) -> Process:
    """``celery -A core beat`` on this test's database and broker (not waited for)."""
    return launch.celery_beat(worker_env(free_port()), name=name)


def test_two_beats_dispatch_once_per_slot_and_the_standby_takes_over() -> None:
    queue = f"beattest-{uuid.uuid4().hex[:8]}"
    key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + queue
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    every, _ = IntervalSchedule.objects.get_or_create(every=INTERVAL, period="seconds")
    PeriodicTask.objects.create(
        name="beat-probe", task="tests.beat_probe", interval=every, queue=queue
    )
    first = start_beat("first")
    second = None
    try:
        assert wait_until(lambda: "took the leader lock" in first.log_text(), timeout=30)
        second = start_beat("second")
        assert wait_until(lambda: "beat: Starting" in second.log_text(), timeout=30)
        assert active_beat() == Holder(host=socket.gethostname(), pid=first.pid)
        broker.delete(key)
        time.sleep(6 * INTERVAL)  # six slots with both beats running
        during = [json.loads(m)["headers"]["id"] for m in broker.lrange(key, 0, -1)]
        assert "took the leader lock" not in second.log_text()  # the standby dispatched nothing

        first.kill()
        killed_at = time.monotonic()
        assert wait_until(
            lambda: "took the leader lock" in second.log_text(),
            timeout=STANDBY_POLL_SECONDS + 5,
        )
        takeover = time.monotonic() - killed_at
        before = broker.llen(key)
        assert wait_until(lambda: broker.llen(key) > before, timeout=INTERVAL + 5)
    finally:
        first.kill()
        if second is not None:
            second.kill()
        broker.delete(key)

    assert 5 <= len(during) <= 7  # one per slot, not one per beat
    assert len(set(during)) == len(during)
    assert takeover <= STANDBY_POLL_SECONDS + 1
    print(
        f"{len(during)} dispatches in {6 * INTERVAL} s with two beats; "
        f"standby took over {takeover:.1f} s after the kill"
    )


def test_beat_survives_its_database_connections_being_cut() -> None:
    """What a PostgreSQL restart does to beat: every connection terminated by the server."""
    queue = f"beattest-{uuid.uuid4().hex[:8]}"
    key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + queue
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    every, _ = IntervalSchedule.objects.get_or_create(every=INTERVAL, period="seconds")
    PeriodicTask.objects.create(
        name="beat-probe", task="tests.beat_probe", interval=every, queue=queue
    )
    beat = start_beat("survivor")
    try:
        assert wait_until(lambda: "took the leader lock" in beat.log_text(), timeout=30)
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            (terminated,) = cursor.fetchone()
        assert terminated >= 1
        broker.delete(key)
        assert wait_until(
            lambda: broker.llen(key) >= 2, timeout=STANDBY_POLL_SECONDS + 4 * INTERVAL
        )
        assert beat.alive()  # still running, dispatching again
    finally:
        beat.kill()
        broker.delete(key)


def test_the_leader_is_named_by_its_own_host_and_pid() -> None:
    """/health/'s beat check and pipeline_status name the beat process itself (the one to
    stop), not the PostgreSQL backend that serves its lock; taking the lock is INFO."""
    beat = start_beat("named")
    try:
        assert wait_until(lambda: "took the leader lock" in beat.log_text(), timeout=30)
        check = beat_check(active_beat())
        out = StringIO()
        call_command("pipeline_status", "--json", stdout=out)
        reported = json.loads(out.getvalue())["health"]["checks"]["beat"]
        out = StringIO()
        call_command("pipeline_status", stdout=out)
        screen = out.getvalue()
    finally:
        beat.kill()

    # The child Popen started is the beat itself: python -m celery, no shell or fork between.
    expected = {"host": socket.gethostname(), "pid": beat.pid}
    assert check == {"status": "ok", "active": expected}
    assert reported["active"] == expected
    assert f"dispatching, pid {beat.pid} on host {socket.gethostname()}" in screen
    [line] = [line for line in beat.log_text().splitlines() if "took the leader lock" in line]
    logger = r"asyncwork\.contrib\.periodic\.beat"
    assert re.search(rf" INFO {logger} beat took the leader lock: dispatching$", line), line
    # Killed: PostgreSQL ends its session, and the lock with it, once it sees the socket closed.
    assert wait_until(lambda: active_beat() is None, timeout=10), active_beat()


def test_beat_warns_at_start_about_a_declared_job_it_has_no_schedule_for() -> None:
    call_command("setup_periodic_tasks", stdout=StringIO())
    PeriodicTask.objects.filter(name="dlq-alert").delete()
    beat = start_beat("unscheduled")
    try:
        assert wait_until(lambda: "took the leader lock" in beat.log_text(), timeout=30)
    finally:
        beat.kill()
    warnings = [line for line in beat.log_text().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert (
        " WARNING asyncwork.contrib.periodic.beat scheduled job dlq-alert (task dlq-alert) "
        "has no enabled" in warnings[0]
    )
    assert {s.name for s in jobs_declared() if s.name in warnings[0]} == {"dlq-alert"}


def test_the_leader_session_has_keepalives_at_the_server_end_too() -> None:
    """PostgreSQL drops the lock session of a leader whose host vanished (a partition: no FIN,
    no RST) within about 20 s, so a standby can take the lock: the server's keepalives are
    set on that session (the system default would keep it for two hours). The chaos suite
    across hosts shows the takeover itself (chaos/hosts.py, beat_host_cut)."""
    conn = beat_module._connect()
    try:
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
        }
    finally:
        conn.close()
    assert shown == {
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "5",
        "tcp_keepalives_count": "3",
    }
