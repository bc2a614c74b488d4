"""The circuit breaker against the real Redis: transitions, one probe among many concurrent
callers, and stepping aside when Redis itself is unreachable."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import Client

from asyncwork.contrib.breaker import Breaker, Decision, Verdict
from invoicing.tasks import email_breaker
from stack.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def new_breaker(*, threshold: int = 3, reset: float = 60, probe_ttl: float = 70) -> Breaker:
    # A name of its own per test: breakers of one run share the Redis key prefix.
    return Breaker(
        f"test-{uuid.uuid4().hex[:8]}",
        threshold=threshold,
        reset_seconds=reset,
        probe_ttl_seconds=probe_ttl,
    )


@pytest.fixture
def breaker() -> Iterator[Breaker]:
    b = new_breaker()
    yield b
    b.reset()


def trip(b: Breaker) -> None:
    for _ in range(b.threshold):
        b.record_failure()


def wait_for_cool_down(b: Breaker) -> None:
    time.sleep(b.reset_seconds + 0.05)


def test_consecutive_failures_up_to_the_threshold_open_it(breaker: Breaker) -> None:
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.allow().verdict is Verdict.ALLOWED
    assert breaker.state()["state"] == "closed"
    assert breaker.state()["failures"] == 2

    breaker.record_failure()

    state = breaker.state()
    assert (state["state"], state["failures"]) == ("open", 3)
    assert state["opened_at"] == pytest.approx(time.time(), abs=5)
    decision = breaker.allow()
    assert decision.verdict is Verdict.DENIED
    assert not decision.allowed
    assert 59 < decision.retry_in <= 60


def test_a_success_resets_the_count_so_only_consecutive_failures_open_it(
    breaker: Breaker,
) -> None:
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state()["state"] == "closed"
    assert breaker.allow().allowed


def test_the_state_is_shared_by_separate_processes(breaker: Breaker) -> None:
    """Another process (another worker) reporting failures opens the breaker here."""
    code = (
        "import django; django.setup(); from asyncwork.contrib.breaker import Breaker; "
        f"b = Breaker({breaker.name!r}, threshold=3, reset_seconds=60, probe_ttl_seconds=70); "
        "[b.record_failure() for _ in range(3)]"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
    assert breaker.allow().verdict is Verdict.DENIED


def test_a_closed_read_is_trusted_for_its_window_and_a_failure_here_ends_it() -> None:
    """With ``check_seconds``, a read that found the breaker closed with no failure is trusted
    for that long: another process opening it meanwhile is seen once the window ends (or at
    once after a failure of this process's own), and a success inside it leaves the shared
    count alone."""
    here = Breaker(
        f"test-{uuid.uuid4().hex[:8]}",
        threshold=3,
        reset_seconds=60,
        probe_ttl_seconds=70,
        check_seconds=0.5,
    )
    shared = redis.Redis.from_url(here.url)  # what another worker's scripts write, written directly

    def opened_elsewhere() -> None:
        seconds, micros = shared.time()
        shared.hset(here.key, mapping={"failures": 3, "opened_at": seconds + micros / 1e6})

    try:
        assert here.allow().verdict is Verdict.ALLOWED  # read: closed, no failure
        opened_elsewhere()
        assert here.allow().verdict is Verdict.ALLOWED  # not asked: inside the window
        time.sleep(0.55)
        assert here.allow().verdict is Verdict.DENIED  # asked again once the window ended

        shared.delete(here.key)
        assert here.allow().verdict is Verdict.ALLOWED
        shared.hincrby(here.key, "failures", 1)  # another worker's failure
        here.record_success()  # inside the window: nothing sent to Redis
        assert here.state()["failures"] == 1
        here.record_failure()  # told at once, and the window ends
        assert here.state()["failures"] == 2
        opened_elsewhere()
        assert here.allow().verdict is Verdict.DENIED
    finally:
        here.reset()


def test_after_the_cool_down_exactly_one_of_many_concurrent_callers_gets_the_probe() -> None:
    b = new_breaker(reset=1)
    trip(b)
    wait_for_cool_down(b)
    assert b.state()["state"] == "half-open"
    callers = 24
    barrier = threading.Barrier(callers)
    decisions: list[Decision] = []
    lock = threading.Lock()

    def ask() -> None:
        barrier.wait()
        decision = b.allow()
        with lock:
            decisions.append(decision)

    threads = [threading.Thread(target=ask) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    verdicts = sorted(d.verdict for d in decisions)
    assert verdicts == [Verdict.DENIED] * (callers - 1) + [Verdict.PROBE]
    # Those turned away wait about one cool-down: the probe decides before then.
    assert all(d.retry_in == pytest.approx(1.0) for d in decisions if not d.allowed)
    assert b.state()["probing"] is True
    b.reset()


def test_a_successful_probe_closes_it() -> None:
    b = new_breaker(reset=1)
    trip(b)
    wait_for_cool_down(b)
    assert b.allow().probe

    b.record_success()

    state = b.state()
    assert (state["state"], state["failures"], state["opened_at"]) == ("closed", 0, None)
    assert state["probing"] is False
    assert all(b.allow().verdict is Verdict.ALLOWED for _ in range(5))


def test_a_failed_probe_opens_it_for_another_cool_down() -> None:
    b = new_breaker(reset=1)
    trip(b)
    first_opened = b.state()["opened_at"]
    wait_for_cool_down(b)
    assert b.allow().probe

    b.record_failure()

    state = b.state()
    assert state["state"] == "open"
    assert state["opened_at"] > first_opened + 1
    assert state["probing"] is False
    decision = b.allow()
    assert decision.verdict is Verdict.DENIED
    assert 0.5 < decision.retry_in <= 1.0
    wait_for_cool_down(b)
    assert b.allow().probe  # and a new probe after the new cool-down
    b.reset()


def test_a_failure_reported_late_by_a_call_let_in_before_it_opened_does_not_extend_it(
    breaker: Breaker,
) -> None:
    trip(breaker)
    opened_at = breaker.state()["opened_at"]
    breaker.record_failure()  # a straggler, while still cooling down
    assert breaker.state()["opened_at"] == opened_at


def test_a_probe_given_back_unused_lets_the_next_caller_probe_at_once() -> None:
    b = new_breaker(reset=1)
    trip(b)
    wait_for_cool_down(b)
    probe = b.allow()
    assert probe.probe
    assert b.allow().verdict is Verdict.DENIED

    b.release_probe(probe)

    assert b.allow().probe
    b.reset()


def test_giving_back_a_probe_that_expired_leaves_the_next_holder_alone() -> None:
    b = new_breaker(reset=1, probe_ttl=0.3)
    trip(b)
    wait_for_cool_down(b)
    stale = b.allow()
    assert stale.probe
    time.sleep(0.4)  # the first probe's worker died: its token expired
    fresh = b.allow()
    assert fresh.probe

    b.release_probe(stale)

    assert b.state()["probing"] is True  # the fresh probe's token is still there
    assert b.allow().verdict is Verdict.DENIED
    b.reset()


def test_redis_refusing_connections_lets_every_call_through_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = Breaker(
        "unreachable",
        threshold=1,
        reset_seconds=60,
        probe_ttl_seconds=70,
        url=f"redis://127.0.0.1:{free_port()}/0",
    )
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asyncwork.contrib.breaker"):
        for _ in range(3):
            b.record_failure()
        decision = b.allow()
        b.record_success()
        state = b.state()
    assert decision.verdict is Verdict.ALLOWED
    assert state["state"] == "unknown"
    assert time.monotonic() - started < 5
    assert any("Redis unavailable" in r.getMessage() for r in caplog.records)


def test_a_redis_that_accepts_but_never_answers_costs_a_caller_about_a_second() -> None:
    """A stalled Redis (the kernel accepts, nobody reads) is bounded by the socket timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        b = Breaker(
            "stalled",
            threshold=1,
            reset_seconds=60,
            probe_ttl_seconds=70,
            url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0",
        )
        started = time.monotonic()
        decision = b.allow()
        elapsed = time.monotonic() - started
    assert decision.allowed
    assert elapsed < 2.0


@pytest.mark.django_db(transaction=True)
def test_health_shows_the_email_breaker_degraded_while_open(settings: Any) -> None:
    # The whole report, not the status alone.
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKEN": "breaker-test-token"}
    client = Client(HTTP_AUTHORIZATION="Bearer breaker-test-token")
    assert client.get("/health/").json()["checks"]["breaker"]["state"] == "closed"
    trip(email_breaker())

    response = client.get("/health/")

    breaker = response.json()["checks"]["breaker"]
    assert (breaker["status"], breaker["state"]) == ("degraded", "open")
    assert breaker["failures"] == email_breaker().threshold
    assert response.json()["failing"] == []  # not critical: emails wait, nothing is lost
