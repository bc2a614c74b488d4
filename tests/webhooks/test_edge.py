"""The nginx edge shipped in deploy/nginx (compose.yaml's ``edge`` service), rendered by its own
render.sh and run for real in front of the application (gunicorn on this run's PostgreSQL):
over-limit webhooks are refused by nginx and never reach Django, one sender cannot take the
capacity others need, slow senders are cut off, and the client address is the real one.

Senders are told apart by the loopback address they connect from (127.0.0.1, .2, .3: Linux
routes all of 127.0.0.0/8 to the loopback interface)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.ingest_load import edge_unlimited
from stack import launch
from stack.launch import GunicornConfig
from stack.nginx import RenderError, nginx_check, render, rendered, setting_names
from tests.helpers.http import Answer, send
from tests.helpers.processes import worker_env
from tests.helpers.stripe import SECRET, WEBHOOK_URL, paid_event
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent

# The tests with the application behind the edge: gunicorn writes to the test database, which
# is emptied after each.
uses_app = pytest.mark.django_db(transaction=True)

SIGNED, FLOOD, SLOW = "127.0.0.1", "127.0.0.2", "127.0.0.3"


# --- the application behind the edge ----------------------------------------------------------


@pytest.fixture(scope="module")
def app(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """gunicorn (3 sync workers, as compose runs it) on this run's test database; its port.
    Behind the edge, the client address is the X-Forwarded-For the edge sets (the edge connects
    from 127.0.0.1, the one trusted proxy)."""
    log = tmp_path_factory.mktemp("edge") / "gunicorn.log"
    env = worker_env(0, TRUSTED_PROXIES=SIGNED)
    # An unsigned POST answered 400 by Django: the application is loaded, not just listening.
    with launch.gunicorn(
        env, config=GunicornConfig(workers=3), log=log, ready_path=WEBHOOK_URL
    ) as server:
        # Every worker past its first request (its first database connection): the tests time
        # the edge, not a cold start.
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda _: send(server.port, body=b"{}"), range(12)))
        yield server.port


def signed(body: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Stripe-Signature": stripe_testing.signature_header(body, SECRET),
    }


def deliver(port: int, *, source: str = SIGNED) -> tuple[str, Answer]:
    """A new signed ``invoice.paid`` delivery from ``source``; its event id and the answer."""
    event = paid_event()
    body = stripe_testing.encode(event)
    return event["id"], send(port, source=source, body=body, headers=signed(body))


def kind(answer: Answer) -> str:
    """What an answer was, for counting: who answered, the status and the error."""
    who = "edge" if answer.from_edge else "app"
    try:
        error = answer.json().get("error", "")
    except ValueError:
        error = ""
    return f"{answer.status} {who} {error}".strip()


def stored() -> set[str]:
    return set(WebhookEvent.objects.values_list("event_id", flat=True))


# --- the capacity guard (what bench.ingest_load measures) -------------------------------------


@uses_app
def test_edge_refuses_what_is_over_its_rate_before_the_application(app: int) -> None:
    """The capacity guard across senders: eight deliveries at once, each from an address of its
    own (so no sender's own limit is reached), against 1 per second with a burst of 2: three
    get through, and only those reach the application."""
    ready = threading.Barrier(8)

    def one(index: int) -> tuple[str, Answer]:
        ready.wait()
        return deliver(port, source=f"127.0.0.{index + 1}")

    with launch.edge(app, rate=1, burst=2, in_flight=8) as nginx, ThreadPoolExecutor(8) as pool:
        port = nginx.port
        answers = list(pool.map(one, range(8)))
    statuses = sorted(answer.status for _, answer in answers)
    assert statuses == [200] * 3 + [429] * 5
    for _, answer in answers:
        if answer.status == 200:
            assert answer.json()["duplicate"] is False
        else:  # nginx's refusal, in the application's shape
            assert answer.from_edge
            assert answer.json() == {"error": "rate limited"}
            assert answer.headers["Retry-After"] == "1"
    # Only what nginx admitted reached the application, and all of it was stored.
    assert stored() == {event_id for event_id, answer in answers if answer.status == 200}


class SlowUpstream(http.server.BaseHTTPRequestHandler):
    """An upstream that takes 1 s per request, like gunicorn stuck behind a slow database."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(1)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def slow_upstream() -> Iterator[int]:
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        yield upstream.server_address[1]
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_edge_refuses_what_is_over_its_in_flight_limit_at_once() -> None:
    """Under its rate but with the upstream slow: beyond ``in_flight`` requests at a time, from
    whichever senders, nginx answers 503 at once rather than queueing them on gunicorn."""
    with (
        slow_upstream() as upstream,
        launch.edge(upstream, rate=1000, burst=100, in_flight=2) as nginx,
    ):
        port = nginx.port

        def post(index: int) -> tuple[float, Answer]:
            started = time.monotonic()
            answer = send(port, source=f"127.0.0.{index + 1}", body=b"{}")
            return time.monotonic() - started, answer

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(post, range(6)))
    assert sorted(answer.status for _, answer in answers) == [200, 200, 503, 503, 503, 503]
    for seconds, answer in answers:
        if answer.status == 503:
            assert seconds < 1  # not queued behind the slow upstream
            assert answer.json() == {"error": "overloaded"}
            assert answer.headers["Retry-After"] == "1"


def test_the_benchmarks_edge_without_limits_refuses_none_of_its_senders() -> None:
    """``bench.ingest_load`` measures the overload's reference through the edge with its limits
    out of the way: every one of its closed-loop senders, all from one address and all in
    flight at once on a slow upstream, is let through (a per-address limit of half the
    whole would refuse half of them if the whole were only the senders)."""
    senders = 16
    ready = threading.Barrier(senders)

    def post(_: int) -> Answer:
        ready.wait()
        return send(port, body=b"{}")

    with (
        slow_upstream() as upstream,
        edge_unlimited(upstream, senders=senders) as nginx,
        ThreadPoolExecutor(senders) as pool,
    ):
        port = nginx.port
        answers = list(pool.map(post, range(senders)))
    assert [answer.status for answer in answers] == [200] * senders


def test_gunicorn_down_is_a_503_to_retry() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nothing = unused.getsockname()[1]  # bound, never listening: connections are refused
        with launch.edge(nothing, rate=10, burst=10, in_flight=4) as nginx:
            port = nginx.port
            answer = send(port, body=b"{}")
    assert answer.status == 503
    assert answer.json() == {"error": "temporarily unavailable"}
    assert answer.headers["Retry-After"] == "1"


# --- the flood: one sender must not take what the others need ---------------------------------

RATE = 40  # the capacity guard in the flood test, webhooks per second in all
FLOOD_SECONDS = 15.0
BODY_TIMEOUT = 2


@dataclass
class Tally:
    answers: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str) -> None:
        with self.lock:
            self.answers[what] += 1


def paced(rate: float, deadline: float, threads: int, send_one: Any) -> None:
    """Call ``send_one(index)`` for request ``index`` at ``index / rate`` seconds from now,
    whatever the earlier ones are doing (open loop), from ``threads`` threads, until
    ``deadline``."""
    start = time.monotonic()
    counter = iter(range(10**9))
    lock = threading.Lock()

    def loop() -> None:
        while True:
            with lock:
                index = next(counter)
            due = start + index / rate
            if due >= deadline:
                return
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            send_one(index)

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


class Flood:
    """Unsigned POSTs from FLOOD, over kept-alive connections, one per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.tally = Tally()
        self.local = threading.local()
        self.connections: list[http.client.HTTPConnection] = []
        self.seconds = 0.0  # from the first request sent to the last answer

    def run(self, rate: float, deadline: float) -> None:
        started = time.monotonic()
        try:
            paced(rate, deadline, 4, self)
        finally:
            self.seconds = time.monotonic() - started
            for connection in self.connections:
                connection.close()

    def __call__(self, index: int) -> None:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(
                "127.0.0.1", self.port, timeout=10, source_address=(FLOOD, 0)
            )
            self.local.connection = connection
            with self.tally.lock:
                self.connections.append(connection)
        with self.tally.lock:
            self.tally.sent += 1
        try:
            connection.request(
                "POST", WEBHOOK_URL, body=b'{"id": "evt_forged"}', headers={"X-Flood": "1"}
            )
            response = connection.getresponse()
            answer = Answer(response.status, response.headers, response.read())
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            self.local.connection = None
            self.tally.add(f"error {type(exc).__name__}")
            return
        self.tally.add(kind(answer))
        if answer.headers.get("Connection", "").lower() == "close":
            connection.close()
            self.local.connection = None


@dataclass
class SlowSender:
    """Connections from SLOW that send their headers, then a body one byte at a time with a
    pause of ``every`` seconds between bytes, each opened again 0.1 s after it ends."""

    port: int
    every: float
    tally: Tally = field(default_factory=Tally)
    closed_after: list[float] = field(default_factory=list)  # from the last byte to the close

    def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.one(deadline)
            time.sleep(0.1)

    def one(self, deadline: float) -> None:
        head = (
            f"POST {WEBHOOK_URL} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", self.port), 10, (SLOW, 0)) as sock:
            sock.sendall(head + b"{")
            last = time.monotonic()
            sock.settimeout(self.every)
            while True:
                try:
                    data = sock.recv(4096)
                except TimeoutError:  # nothing from nginx: the next byte, if there is time
                    if time.monotonic() > deadline:
                        self.tally.add("still open at the end")
                        return
                    with contextlib.suppress(OSError):  # closed meanwhile: recv will say so
                        sock.sendall(b" ")
                    last = time.monotonic()
                    continue
                except ConnectionResetError:
                    data = b""
                if data:  # refused before its body was read
                    status = int(data.split(b" ", 2)[1])
                    self.tally.add(f"{status} edge before the body")
                else:
                    self.closed_after.append(time.monotonic() - last)
                    self.tally.add("closed by the edge mid-body")
                return


@uses_app
@pytest.mark.slow
def test_a_flood_and_slow_bodies_do_not_keep_signed_deliveries_out(
    app: int, record_property: Any
) -> None:
    """The issue's scenario: from 127.0.0.2 unsigned POSTs at 5x the edge's rate, from 127.0.0.3
    eight connections at a time dribbling their bodies too slowly, and from 127.0.0.1 a signed
    sender at 20% of the rate. At least 99% of the signed deliveries are answered 200 the first
    time they are sent."""
    settings = {"EDGE_BODY_TIMEOUT": BODY_TIMEOUT, "EDGE_HEADER_TIMEOUT": BODY_TIMEOUT}
    with launch.edge(app, rate=RATE, burst=10, in_flight=8, settings=settings) as nginx:
        port = nginx.port
        flood = Flood(port)
        slow = SlowSender(port, every=BODY_TIMEOUT + 1)
        signed_tally = Tally()
        admitted: list[str] = []

        def signed_one(_: int) -> None:
            with signed_tally.lock:
                signed_tally.sent += 1
            try:
                event_id, answer = deliver(port)
            except (OSError, http.client.HTTPException) as exc:
                signed_tally.add(f"error {type(exc).__name__}")
                return
            signed_tally.add(kind(answer))
            if answer.status == 200:
                with signed_tally.lock:
                    admitted.append(event_id)

        started = time.monotonic()
        deadline = started + FLOOD_SECONDS
        senders = [
            threading.Thread(target=flood.run, args=(5 * RATE, deadline)),
            threading.Thread(target=paced, args=(0.2 * RATE, deadline, 2, signed_one)),
            *(threading.Thread(target=slow.run, args=(deadline,)) for _ in range(8)),
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        elapsed = time.monotonic() - started

    first_try = signed_tally.answers["200 app"] / signed_tally.sent
    figures = {
        "seconds": round(elapsed, 1),
        "edge_rate_per_s": RATE,
        "signed": {
            "sent": signed_tally.sent,
            "answers": dict(signed_tally.answers),
            "200_first_try": round(first_try, 4),
        },
        "flood": {
            "sent": flood.tally.sent,
            "rate_per_s": round(flood.tally.sent / flood.seconds, 1),
            "answers": dict(flood.tally.answers),
        },
        "slow": {
            "answers": dict(slow.tally.answers),
            "closed_after_s": {
                "min": round(min(slow.closed_after, default=0), 2),
                "max": round(max(slow.closed_after, default=0), 2),
            },
        },
    }
    record_property("edge_flood", figures)
    print("\nedge flood:", json.dumps(figures))

    # The attack happened as described: the flood at about 5x the rate, the slow bodies held
    # open until the edge cut them off.
    assert flood.tally.sent / flood.seconds >= 4.5 * RATE
    assert signed_tally.sent >= 0.2 * RATE * FLOOD_SECONDS - 2
    assert slow.closed_after
    # The measure.
    assert first_try >= 0.99, figures
    assert stored() == set(admitted)
    # The flood's share reached Django (its unsigned POSTs answered 400 there) at its own rate,
    # half the edge's, and nothing else of it did: the rest was refused by nginx.
    reached = sum(n for what, n in flood.tally.answers.items() if " app" in what)
    assert reached <= RATE / 2 * elapsed + 10, figures
    assert flood.tally.answers["429 edge rate limited"] >= flood.tally.sent - reached - 5
    # A body pausing longer than EDGE_BODY_TIMEOUT is cut off then, not after nginx's 60 s.
    assert max(slow.closed_after) < BODY_TIMEOUT + 1.0, figures
    assert min(slow.closed_after) > BODY_TIMEOUT - 0.5, figures


# --- slow senders ------------------------------------------------------------------------------


def closed_after(port: int, request: bytes, *, limit: float = 30) -> float:
    """Send ``request`` (an incomplete one) from SLOW, then nothing; seconds until the edge
    closes the connection without an answer."""
    with socket.create_connection(("127.0.0.1", port), 10, (SLOW, 0)) as sock:
        sock.sendall(request)
        sent = time.monotonic()
        sock.settimeout(limit)
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            data = b""
        assert data == b"", data  # closed, not answered
        return time.monotonic() - sent


@pytest.mark.slow
def test_stalled_headers_and_bodies_are_closed_after_their_timeouts(app: int) -> None:
    settings = {"EDGE_HEADER_TIMEOUT": 2, "EDGE_BODY_TIMEOUT": 3}
    with launch.edge(app, rate=10, burst=10, in_flight=4, settings=settings) as nginx:
        port = nginx.port
        headers = closed_after(port, f"POST {WEBHOOK_URL} HTTP/1.1\r\nHost: 127.0".encode())
        head = f"POST {WEBHOOK_URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
        body = closed_after(port, head.encode() + b"{")
    print(f"\nstalled headers closed after {headers:.2f} s, stalled body after {body:.2f} s")
    assert 1.5 < headers < 3.0
    assert 2.5 < body < 4.0


@uses_app
@pytest.mark.slow
def test_bodies_sent_slowly_do_not_take_the_capacity(app: int) -> None:
    """Bodies dribbled just fast enough never to time out: one address holds at most its own
    connections (then 429 at once), and none of them counts against the in-flight limit to
    gunicorn, which nginx charges only once it has the whole body. (Charged on the headers, two
    such connections took both slots here, and every delivery got 503.)"""
    settings = {"EDGE_BODY_TIMEOUT": 2, "WEBHOOK_EDGE_ADDRESS_CONNECTIONS": 2}
    with launch.edge(app, rate=100, burst=20, in_flight=2, settings=settings) as nginx:
        port = nginx.port
        stop = threading.Event()
        head = (
            f"POST {WEBHOOK_URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
        ).encode()
        held = [socket.create_connection(("127.0.0.1", port), 10, (SLOW, 0)) for _ in range(2)]

        def dribble() -> None:
            for sock in held:
                sock.sendall(head)
            while not stop.wait(0.5):
                for sock in held:
                    sock.sendall(b" ")

        dribbler = threading.Thread(target=dribble)
        dribbler.start()
        try:
            time.sleep(0.5)
            third = send(port, source=SLOW, body=b"{}")
            results = [deliver(port) for _ in range(6)]
            with ThreadPoolExecutor(2) as pool:
                results += list(pool.map(lambda _: deliver(port), range(4)))
            still_held = []
            for sock in held:
                sock.setblocking(False)
                try:
                    sock.recv(1)  # an answer, or b"" for a close: either way, let go of
                    still_held.append(False)
                except BlockingIOError:  # nothing to read: still open, its body being read
                    still_held.append(True)
        finally:
            stop.set()
            dribbler.join()
            for sock in held:
                sock.close()
    assert third.status == 429
    assert third.json() == {"error": "rate limited"}
    assert [answer.status for _, answer in results] == [200] * 10
    assert still_held == [True, True]  # the slow ones were still being read all along
    assert stored() == {event_id for event_id, _ in results}


# --- who may send ------------------------------------------------------------------------------


@uses_app
def test_outside_the_allowed_sources_is_403_at_the_edge(app: int) -> None:
    settings = {"WEBHOOK_ALLOWED_SOURCES": "10.0.0.0/8, 127.0.0.1/32"}
    with launch.edge(app, rate=1, burst=1, in_flight=4, settings=settings) as nginx:
        port = nginx.port
        refused = [deliver(port, source=FLOOD) for _ in range(20)]
        # Refused before any limit was charged: the capacity (1 per second, burst 1) is whole.
        allowed = [deliver(port, source=SIGNED) for _ in range(2)]
        health = send(port, source=FLOOD, method="GET", path="/health/")
    for _, answer in refused:
        assert answer.status == 403
        assert answer.from_edge
        assert answer.json() == {"error": "source address not allowed"}
        assert answer.headers["Content-Type"] == "application/json"
    assert [answer.status for _, answer in allowed] == [200, 200]
    assert stored() == {event_id for event_id, _ in allowed}  # none of the refused reached Django
    assert not health.from_edge  # the allow-list is the webhook's only


@uses_app
def test_an_allowed_source_behind_a_trusted_proxy_is_judged_by_its_own_address(app: int) -> None:
    settings = {"WEBHOOK_ALLOWED_SOURCES": "203.0.113.0/24", "EDGE_TRUSTED_PROXIES": SIGNED}
    with launch.edge(app, rate=10, burst=10, in_flight=4, settings=settings) as nginx:
        port = nginx.port
        body = stripe_testing.encode(paid_event())
        inside = send(port, body=body, headers={**signed(body), "X-Forwarded-For": "203.0.113.9"})
        outside = send(port, body=body, headers={**signed(body), "X-Forwarded-For": "10.1.1.1"})
        # Not a trusted proxy: its X-Forwarded-For is only a header.
        claimed = send(
            port,
            source=FLOOD,
            body=body,
            headers={**signed(body), "X-Forwarded-For": "203.0.113.9"},
        )
    assert inside.status == 200
    assert (outside.status, claimed.status) == (403, 403)


# --- the real client address ------------------------------------------------------------------


def at_once(port: int, senders: list[tuple[str, str]]) -> list[str]:
    """Unsigned POSTs sent all at once, one per ``(source, X-Forwarded-For)``: who answered
    them (Django says 400), sorted. At once, so that what a limit lets through does not depend
    on how fast the application answers."""
    ready = threading.Barrier(len(senders))

    def one(sender: tuple[str, str]) -> str:
        source, forwarded = sender
        ready.wait()
        answer = send(port, source=source, body=b"{}", headers={"X-Forwarded-For": forwarded})
        return "edge" if answer.from_edge else "app"

    with ThreadPoolExecutor(len(senders)) as pool:
        return sorted(pool.map(one, senders))


@uses_app
def test_behind_a_trusted_proxy_each_forwarded_address_has_its_own_limit(app: int) -> None:
    settings = {
        "EDGE_TRUSTED_PROXIES": f"{SIGNED}/32",
        # One request per second and address, one more at once: 2 of 4 at once get through.
        "WEBHOOK_EDGE_ADDRESS_RATE": 1,
        "WEBHOOK_EDGE_ADDRESS_BURST": 1,
    }
    with launch.edge(app, rate=1000, burst=100, in_flight=16, settings=settings) as nginx:
        port = nginx.port
        # Through the trusted proxy (127.0.0.1): one limit per address it names, and that is
        # the rightmost address that is not a trusted proxy, whatever the client put before it.
        named = at_once(
            port,
            [(SIGNED, "203.0.113.7")] * 2 + [(SIGNED, "198.51.100.1, 203.0.113.7")] * 2,
        )
        other = at_once(port, [(SIGNED, "203.0.113.8")] * 2)
        # Not a trusted proxy (127.0.0.2): changing X-Forwarded-For does not buy a new limit.
        untrusted = at_once(port, [(FLOOD, f"198.51.100.{n}") for n in range(4)])
        # The application sees the address the edge judged (TRUSTED_PROXIES is the edge):
        # /metrics answers only loopback addresses (its default).
        metrics = {
            forwarded: send(port, source=source, method="GET", path="/metrics", headers=xff).status
            for source, forwarded, xff in [
                (SIGNED, "public", {"X-Forwarded-For": "203.0.113.50"}),
                (SIGNED, "private", {"X-Forwarded-For": "10.9.8.7"}),
                (SIGNED, "loopback", {"X-Forwarded-For": "127.0.0.9"}),
                (SIGNED, "loopback, then public", {"X-Forwarded-For": "127.0.0.9, 203.0.113.50"}),
                (FLOOD, "public, untrusted", {"X-Forwarded-For": "203.0.113.50"}),
            ]
        }
    assert named == ["app", "app", "edge", "edge"]
    assert other == ["app", "app"]
    assert untrusted == ["app", "app", "edge", "edge"]
    assert metrics == {
        "public": 403,
        "private": 403,
        "loopback": 200,
        "loopback, then public": 403,
        "public, untrusted": 200,  # judged as 127.0.0.2
    }


# --- /health/ and /admin/login/ ---------------------------------------------------------------


@uses_app
def test_health_and_admin_login_are_limited_per_address(app: int) -> None:
    settings = {
        "EDGE_HEALTH_RATE": 1,
        "EDGE_HEALTH_BURST": 2,
        "EDGE_LOGIN_RATE": 1,
        "EDGE_LOGIN_BURST": 2,
    }
    with launch.edge(app, rate=10, burst=10, in_flight=4, settings=settings) as nginx:
        port = nginx.port
        for path, retry_after in (("/health/", "1"), ("/admin/login/", "60")):
            # Six at once from one address: the limit is 1 per second (per minute for the
            # login) with a burst of 2, however long the application takes to answer.
            with ThreadPoolExecutor(6) as pool:
                flood = list(
                    pool.map(
                        lambda _, path=path: send(port, source=FLOOD, method="GET", path=path),
                        range(6),
                    )
                )
            other = send(port, source=SLOW, method="GET", path=path)
            refused = [answer for answer in flood if answer.from_edge]
            assert len(refused) == 3, path
            assert {a.status for a in flood if not a.from_edge} <= {200, 503}  # the app's own
            for answer in refused:
                assert answer.status == 429
                assert answer.json() == {"error": "rate limited"}
                assert answer.headers["Retry-After"] == retry_after
            # Another address is not held back by the first one's limit.
            assert not other.from_edge, path


# --- the renderer ------------------------------------------------------------------------------

BASE = {"APP_UPSTREAM": "web:8000", "EDGE_LISTEN": 8080}


def test_render_fills_in_the_settings_and_derives_the_per_address_ones() -> None:
    text = rendered(
        {
            **BASE,
            "WEBHOOK_EDGE_RATE": 7,
            "WEBHOOK_EDGE_BURST": 3,
            "WEBHOOK_EDGE_CONNECTIONS": 6,
            "WEBHOOK_ALLOWED_SOURCES": "3.18.12.63, 2001:db8::/32",
            "EDGE_TRUSTED_PROXIES": "10.0.0.0/8",
        }
    )
    assert 'limit_req_zone "webhooks" zone=webhooks:1m rate=7r/s;' in text
    assert "burst=3 nodelay" in text
    assert "limit_conn webhooks_in_flight 6;" in text
    # One address: half of each, rounded up.
    assert "zone=webhook_address:10m rate=4r/s;" in text
    assert "limit_req zone=webhook_address burst=2 nodelay;" in text
    assert "limit_conn webhook_address_open 3;" in text
    assert "    default 0;\n    3.18.12.63 1;\n    2001:db8::/32 1;\n" in text
    assert "    set_real_ip_from 10.0.0.0/8;\n    real_ip_header X-Forwarded-For;\n" in text
    assert "$binary_remote_addr" in text  # nginx's own variables are left alone
    assert "${" not in text.replace("${...}", "")


def test_render_with_the_defaults_lets_every_address_in_and_trusts_no_proxy() -> None:
    text = rendered(BASE)
    assert "    default 1;" in text
    assert "set_real_ip_from" not in text
    assert "rate=50r/s" in text
    assert "client_body_timeout 5s;" in text
    assert "client_max_body_size 1048576;" in text  # the application's WEBHOOK_MAX_BODY_BYTES


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"WEBHOOK_ALLOWED_SOURCES": "10.0.0.0/33"}, "WEBHOOK_ALLOWED_SOURCES: '10.0.0.0/33' is"),
        ({"WEBHOOK_ALLOWED_SOURCES": "3.18.12.63,,10.0.0.0/8"}, "has an empty entry"),
        ({"WEBHOOK_ALLOWED_SOURCES": "10.0.0.256"}, "'10.0.0.256' is not a network"),
        ({"WEBHOOK_ALLOWED_SOURCES": "1.2.3.4 5"}, "'1.2.3.4 5' is not a network"),
        ({"WEBHOOK_ALLOWED_SOURCES": "1.2.3.4; allow all"}, "is not a network"),
        ({"EDGE_TRUSTED_PROXIES": "2001:db8::1::/64"}, "EDGE_TRUSTED_PROXIES: '2001:db8::1::/64'"),
        ({"WEBHOOK_EDGE_RATE": "fast"}, "WEBHOOK_EDGE_RATE must be a whole number"),
        ({"WEBHOOK_EDGE_BURST": 0}, "WEBHOOK_EDGE_BURST must be a whole number of at least 1"),
        ({"WEBHOOK_EDGE_ADDRESS_RATE": 60}, "WEBHOOK_EDGE_ADDRESS_RATE (60) is above"),
        ({"APP_UPSTREAM": "web:8000; include /etc/passwd"}, "APP_UPSTREAM must be"),
        ({"EDGE_LISTEN": ""}, "EDGE_LISTEN is required"),
    ],
)
def test_render_refuses_a_bad_setting_with_a_message_naming_it(
    settings: dict[str, str | int], message: str
) -> None:
    with pytest.raises(RenderError, match=r"^edge: ") as error:
        rendered({**BASE, **settings})
    assert message in str(error.value)


def test_render_writes_nothing_when_it_refuses(tmp_path: Path) -> None:
    output = tmp_path / "default.conf"
    output.write_text("the previous configuration\n")
    env = {**BASE, "WEBHOOK_ALLOWED_SOURCES": "not-a-network"}
    with pytest.raises(RenderError):
        render(env, output)
    assert output.read_text() == "the previous configuration\n"
    assert [p.name for p in tmp_path.iterdir()] == ["default.conf"]


def test_nginx_accepts_what_render_makes_of_every_list() -> None:
    nginx_check(
        {
            **BASE,
            "APP_UPSTREAM": "127.0.0.1:8000",  # "web" resolves inside compose only
            "WEBHOOK_ALLOWED_SOURCES": "3.18.12.63,10.0.0.0/8,2001:db8::/32,::ffff:192.0.2.1",
            "EDGE_TRUSTED_PROXIES": "172.16.0.0/12,::1",
        }
    )


def test_the_settings_render_reads_are_the_templates() -> None:
    names = set(setting_names())
    template = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "default.conf.template"
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)\}", template.read_text()))
    assert used - {"EDGE_LOGIN_RETRY_AFTER"} == names


def test_the_healthchecks_compose_runs_pass_through_the_edge(live_server: Any) -> None:
    """compose.yaml's edge healthcheck fetches /health/live through nginx; anonymous /health/
    through it says the status alone."""
    upstream = int(live_server.url.rsplit(":", 1)[1])
    with launch.edge(upstream, rate=50, burst=10, in_flight=4) as nginx:
        port = nginx.port
        live = requests.get(f"http://127.0.0.1:{port}/health/live", timeout=10)
        ready = requests.get(f"http://127.0.0.1:{port}/health/", timeout=10)
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert set(ready.json()) == {"status"}
