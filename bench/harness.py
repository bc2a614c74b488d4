"""Loading the application over HTTP, for every benchmark, and the requests it is loaded with.

``load()`` is a closed-loop generator: ``concurrency`` threads each send one pre-built request,
wait for the complete response, and send the next, for a fixed time or until the requests run
out. Requests are raw HTTP/1.1 bytes built before timing; the client parses just enough of the
response (status line, ``Content-Length``, ``Connection``) to keep its own CPU cost small on a
machine it shares with the server. A latency runs from the first byte sent (the connect, when
the server closed the previous connection) to the last byte of the response.

``pace()`` is the open-loop counterpart: request ``i`` is due ``i / rate`` seconds after the
start, whatever the server is doing with the earlier ones, and its latency runs from when it was
due, so a server that falls behind is charged for the wait (no coordinated omission).

``signed_requests()`` and ``paid_batch()`` build Stripe deliveries as Stripe sends them, signed
(the signature covers the time: build them just before use).
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from stack import stripe_events
from stack.net import HOST

WEBHOOK_PATH = "/webhooks/stripe/"
# The headers Stripe sends with a delivery, besides Stripe-Signature.
STRIPE_HEADERS = {
    "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
    "Content-Type": "application/json; charset=utf-8",
    "Accept": "*/*; q=0.5, application/xml",
    "Cache-Control": "no-cache",
}
# What the webhook answers to a new event it stored.
ACCEPTED_BODY = b'"duplicate": false'


def http_request(
    *, path: str, body: bytes, port: int, headers: Mapping[str, str] | None = None
) -> bytes:
    """A complete HTTP/1.1 POST, ready to write to a socket."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {HOST}:{port}",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Response:
    __slots__ = ("body", "keep_alive", "status")

    def __init__(self, status: int, body: bytes, keep_alive: bool) -> None:
        self.status = status
        self.body = body
        self.keep_alive = keep_alive


def _exchange(sock: socket.socket, request: bytes) -> _Response:
    sock.sendall(request)
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before the response headers")
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    keep_alive = headers.get(b"connection") != b"close"
    if b"content-length" not in headers:
        if headers.get(b"transfer-encoding") or keep_alive:
            raise ConnectionError("response framed other than by Content-Length or close")
        while chunk := sock.recv(65536):
            body += chunk
        return _Response(status, body, keep_alive=False)
    length = int(headers[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed inside the response body")
        body += chunk
    return _Response(status, body, keep_alive)


def _connect(port: int, timeout: float, source: str = HOST) -> socket.socket:
    bind = (source, 0) if source != HOST else None
    sock = socket.create_connection((HOST, port), timeout=timeout, source_address=bind)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@dataclass
class LoadResult:
    """One closed-loop run: latencies (seconds) of the successful requests, failures by kind."""

    elapsed: float
    latencies: list[float]
    errors: Counter[str]
    exhausted: bool  # the requests ran out before the duration did

    @property
    def successes(self) -> int:
        return len(self.latencies)

    @property
    def requests(self) -> int:
        return self.successes + sum(self.errors.values())

    @property
    def rate(self) -> float:
        """Successful requests per second."""
        return self.successes / self.elapsed if self.elapsed > 0 else 0.0


def percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending sequence (``nan`` when it is empty)."""
    if not ordered:
        return math.nan
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50_ms": percentile(ordered, 50) * 1000,
        "p99_ms": percentile(ordered, 99) * 1000,
        "p99_9_ms": percentile(ordered, 99.9) * 1000,
        "max_ms": ordered[-1] * 1000 if ordered else math.nan,
    }


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    exhausted: bool = False
    crash: BaseException | None = None


@dataclass(frozen=True)
class _Plan:
    port: int
    requests: Sequence[bytes]
    cycle: bool
    expect: bytes
    deadline: float
    timeout: float
    next_index: Iterator[int]  # itertools.count: next() is atomic under the GIL
    stop: threading.Event


def _send_loop(plan: _Plan, tally: _Tally) -> None:
    total = len(plan.requests)
    sock: socket.socket | None = None
    try:
        while not plan.stop.is_set() and time.perf_counter() < plan.deadline:
            index = next(plan.next_index)
            if index >= total:
                if not plan.cycle:
                    tally.exhausted = True
                    break
                index %= total
            started = time.perf_counter()
            try:
                if sock is None:
                    sock = _connect(plan.port, plan.timeout)
                response = _exchange(sock, plan.requests[index])
            except (OSError, ValueError) as exc:
                tally.errors[type(exc).__name__] += 1
                if sock is not None:
                    sock.close()
                    sock = None
                continue
            latency = time.perf_counter() - started
            if not response.keep_alive:
                sock.close()
                sock = None
            if response.status != 200:
                tally.errors[f"HTTP {response.status}"] += 1
            elif plan.expect not in response.body:
                tally.errors["unexpected body"] += 1
            else:
                tally.latencies.append(latency)
    except BaseException as exc:  # reported by load(), not lost with the thread
        tally.crash = exc
    finally:
        if sock is not None:
            sock.close()


def load(
    *,
    port: int,
    requests: Sequence[bytes],
    duration: float,
    concurrency: int,
    expect: bytes,
    cycle: bool,
    timeout: float = 30.0,
) -> LoadResult:
    """Send ``requests`` from ``concurrency`` threads for ``duration`` seconds.

    With ``cycle`` the requests are sent round and round; without, each is sent once and the
    run ends early if they run out (``exhausted``). A success is a 200 whose body contains
    ``expect``; anything else (status, body, socket error, timeout) is counted by kind.
    """
    if not requests:
        raise ValueError("no requests to send")
    plan = _Plan(
        port=port,
        requests=requests,
        cycle=cycle,
        expect=expect,
        deadline=time.perf_counter() + duration,
        timeout=timeout,
        next_index=itertools.count(),
        stop=threading.Event(),
    )
    tallies = [_Tally() for _ in range(concurrency)]
    threads = [
        threading.Thread(target=_send_loop, args=(plan, tally), daemon=True) for tally in tallies
    ]
    started = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        plan.stop.set()
        for thread in threads:
            thread.join(timeout + 1)
    elapsed = time.perf_counter() - started
    for tally in tallies:
        if tally.crash is not None:
            raise RuntimeError("a load thread failed") from tally.crash
    return LoadResult(
        elapsed=elapsed,
        latencies=[latency for tally in tallies for latency in tally.latencies],
        errors=sum((tally.errors for tally in tallies), Counter()),
        exhausted=any(tally.exhausted for tally in tallies),
    )


# --- Open loop ----------------------------------------------------------------------------------


@dataclass
class Paced:
    """One request of an open-loop run. Times are seconds from the run's start: when it was
    due, when it was actually sent (later than due when every sender was busy), when its
    response ended. ``status`` is 0 when the exchange failed (``error`` says how)."""

    due: float
    sent: float
    done: float
    status: int
    body: bytes
    error: str = ""

    @property
    def latency(self) -> float:
        """From when the request was due: what a client sending on schedule waits, lag
        included (no coordinated omission)."""
        return self.done - self.due

    @property
    def lag(self) -> float:
        return self.sent - self.due


@dataclass
class PacedResult:
    rate: float  # requests per second offered
    outcomes: list[Paced | None]  # by request index; None: never sent (stopped)
    elapsed: float  # from the start to the last response
    started_at: float = 0.0  # the start as time.time(), to compare with other clocks

    def sent(self) -> list[Paced]:
        return [outcome for outcome in self.outcomes if outcome is not None]


def _pace_loop(
    *,
    port: int,
    source: str,
    requests: Sequence[bytes],
    rate: float,
    start: float,
    timeout: float,
    next_index: Iterator[int],
    stop: threading.Event,
    outcomes: list[Paced | None],
    crash: list[BaseException],
) -> None:
    sock: socket.socket | None = None
    try:
        while not stop.is_set():
            index = next(next_index)
            if index >= len(requests):
                break
            due = index / rate
            wait = start + due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            sent = time.perf_counter() - start
            try:
                if sock is None:
                    sock = _connect(port, timeout, source)
                response = _exchange(sock, requests[index])
            except (OSError, ValueError) as exc:
                if sock is not None:
                    sock.close()
                    sock = None
                done = time.perf_counter() - start
                outcomes[index] = Paced(due, sent, done, 0, b"", type(exc).__name__)
                continue
            done = time.perf_counter() - start
            if not response.keep_alive:
                sock.close()
                sock = None
            outcomes[index] = Paced(due, sent, done, response.status, response.body)
    except BaseException as exc:  # reported by pace(), not lost with the thread
        crash.append(exc)
    finally:
        if sock is not None:
            sock.close()


def pace(
    *,
    port: int,
    requests: Sequence[bytes],
    rate: float,
    senders: int,
    timeout: float = 30.0,
    sources: Sequence[str] = (HOST,),
) -> PacedResult:
    """Send request ``i`` at ``i / rate`` seconds from the start, whatever the earlier ones
    are doing (open loop), from ``senders`` threads; each request is sent once. The run lasts
    ``len(requests) / rate`` seconds plus the last responses. A request is late only when all
    the senders are waiting on responses: its ``lag`` shows it, and its latency counts it.
    The senders connect from the loopback addresses in ``sources`` in turn (a provider sends
    from several addresses; an edge limiting each address tells them apart).
    """
    if rate <= 0 or not requests:
        raise ValueError("need a positive rate and requests to send")
    outcomes: list[Paced | None] = [None] * len(requests)
    crash: list[BaseException] = []
    stop = threading.Event()
    # Every thread started before the first request is due.
    start = time.perf_counter() + 0.05 + 0.001 * senders
    started_at = time.time() + (start - time.perf_counter())
    # One counter shared by every thread: itertools.count's next() is atomic under the GIL.
    shared = itertools.count()
    threads = [
        threading.Thread(
            target=_pace_loop,
            kwargs={
                "port": port,
                "source": sources[number % len(sources)],
                "requests": requests,
                "rate": rate,
                "start": start,
                "timeout": timeout,
                "next_index": shared,
                "stop": stop,
                "outcomes": outcomes,
                "crash": crash,
            },
            daemon=True,
        )
        for number in range(senders)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout + 1)
    if crash:
        raise RuntimeError("a pacing thread failed") from crash[0]
    done = [outcome.done for outcome in outcomes if outcome is not None]
    return PacedResult(
        rate=rate, outcomes=outcomes, elapsed=max(done, default=0.0), started_at=started_at
    )


# --- Stripe deliveries --------------------------------------------------------------------------


def paid_event() -> bytes:
    """A new ``invoice.paid`` event for a new invoice, encoded as Stripe sends it."""
    invoice = stripe_events.invoice_object(invoice_id=stripe_events.new_id("in"))
    return stripe_events.encode(stripe_events.event("invoice.paid", invoice))


def signed_requests(bodies: Sequence[bytes], *, path: str, port: int, secret: str) -> list[bytes]:
    """Each body as a delivery signed now, as Stripe signs it (the signature covers ``t``)."""
    now = int(time.time())
    return [
        http_request(
            path=path,
            body=body,
            port=port,
            headers={
                **STRIPE_HEADERS,
                "Stripe-Signature": stripe_events.signature_header(body, secret, timestamp=now),
            },
        )
        for body in bodies
    ]


@dataclass(frozen=True)
class Batch:
    """Signed ``invoice.paid`` deliveries, each for a new invoice, and those invoices' ids."""

    invoice_ids: list[str]
    requests: list[bytes]


def paid_batch(
    count: int, *, port: int, secret: str, path: str = WEBHOOK_PATH, recipients: str = ""
) -> Batch:
    """``count`` new paid invoices as Stripe deliveries to ``path``, signed now (build just
    before use: the signature is valid for ``STRIPE_WEBHOOK_TOLERANCE``, 300 s by default).
    ``recipients``: a domain, to give each invoice a customer email of its own,
    ``<invoice id>@<domain>``."""
    ids = [stripe_events.new_id("in") for _ in range(count)]
    objects = [
        stripe_events.invoice_object(invoice_id=invoice, customer_email=f"{invoice}@{recipients}")
        if recipients
        else stripe_events.invoice_object(invoice_id=invoice)
        for invoice in ids
    ]
    bodies = [
        stripe_events.encode(stripe_events.event("invoice.paid", invoice)) for invoice in objects
    ]
    return Batch(
        invoice_ids=ids,
        requests=signed_requests(bodies, path=path, port=port, secret=secret),
    )
