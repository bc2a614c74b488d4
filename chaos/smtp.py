"""A fault-injecting SMTP server (aiosmtpd, in the orchestrator's process) and its record of
every message it accepted.

What it does to the mail it is sent:

* every recipient in ``refused_domain`` is refused with ``550 5.1.1`` at RCPT: a permanent
  refusal, which the application must dead-letter, never retry;
* about ``defer_rate`` of DATA attempts are answered ``451 4.3.0``, a given Message-ID at most
  ``max_deferrals`` times: a transient fault that clears, as greylisting and a full spool do.
  (Uncapped and independent, 20 % deferrals would exhaust five attempts for one invoice in
  3,125 by arithmetic alone; that measures the retry budget, not resilience to faults, and
  the kills and restarts below spend attempts too.) ``max_deferrals=0`` removes the cap;
* about ``slow_rate`` of replies to DATA are delayed by ``slow_min``..``slow_max`` seconds
  (an asyncio sleep: other sessions carry on);
* on request (``hold``), the next DATA is held for a few seconds so the orchestrator can kill
  the worker inside it: ``in_window`` holds it after the message is committed and before the
  250 is sent; ``outside`` holds a DATA that will be answered 451, so nothing is committed.

What it records:

* every accepted message (Message-ID, recipient, time), committed *before* the 250 is sent,
  as a real MTA queues a message before acknowledging it: a client that dies before it reads
  the 250 has still delivered the message. That is the crash window;
* every session lost (closed without QUIT) after its message was committed (``cuts``): a send
  cut inside the crash window, whatever cut it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from chaos.stack import HOST, free_port

IN_WINDOW = "in_window"
OUTSIDE = "outside"


@dataclass(frozen=True)
class SmtpFaults:
    defer_rate: float = 0.2
    max_deferrals: int = 2
    slow_rate: float = 0.1
    slow_min: float = 1.0
    slow_max: float = 4.0
    refused_domain: str = "refused.example.com"


@dataclass(frozen=True)
class Accepted:
    message_id: str
    recipient: str
    at: float  # time.time()


@dataclass(frozen=True)
class InData:
    """A session inside DATA: ``data`` (not decided yet, or deciding 451) or ``committed``
    (the message is accepted; the client has not quit yet: ``accepted`` is its index in
    the record)."""

    state: str
    message_id: str
    recipient: str
    accepted: int = -1


@dataclass
class Hold:
    """A request to hold the next DATA for ``seconds``; ``reached`` is set once a session is
    held, with its client port and Message-ID."""

    kind: str
    seconds: float
    reached: threading.Event = field(default_factory=threading.Event)
    peer_port: int = 0
    message_id: str = ""


def _client_port(session: Session) -> int:
    """The client's port: the key of a session, and of the socket the orchestrator looks for."""
    peer = session.peer
    return int(peer[1]) if isinstance(peer, tuple) else 0


class FaultyHandler:
    def __init__(self, faults: SmtpFaults, seed: int) -> None:
        self.faults = faults
        self.rng = random.Random(seed)  # noqa: S311 - fault injection, not secrets
        self.lock = threading.Lock()
        self.accepted: list[Accepted] = []
        self.cuts: list[tuple[float, InData]] = []
        # index in ``accepted`` -> how the session ended: "quit" or "cut" (no QUIT)
        self.endings: dict[int, str] = {}
        self.in_data: dict[int, InData] = {}  # client port -> session inside DATA
        self.deferrals: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self._hold: Hold | None = None

    # --- what the orchestrator asks ----------------------------------------------------------

    def hold_next(self, kind: str, seconds: float) -> Hold:
        hold = Hold(kind=kind, seconds=seconds)
        with self.lock:
            self._hold = hold
        return hold

    def hold_cancel(self, hold: Hold) -> None:
        with self.lock:
            if self._hold is hold:
                self._hold = None

    def sessions_in_data(self) -> dict[int, InData]:
        with self.lock:
            return dict(self.in_data)

    def accepted_count(self) -> int:
        with self.lock:
            return len(self.accepted)

    # --- SMTP hooks ----------------------------------------------------------------------------

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if address.lower().endswith("@" + self.faults.refused_domain):
            with self.lock:
                self.counts["refused_at_rcpt"] += 1
            return "550 5.1.1 <" + address + ">: mailbox unavailable"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        content = envelope.content if isinstance(envelope.content, bytes) else b""
        message_id = str(BytesHeaderParser().parsebytes(content).get("Message-ID", "")).strip()
        recipient = (envelope.rcpt_tos or [""])[0].lower()
        port = _client_port(session)
        with self.lock:
            self.counts["data_attempts"] += 1
            hold, self._hold = self._hold, None
            if hold is not None:
                defer = hold.kind == OUTSIDE
            else:
                capped = 0 < self.faults.max_deferrals <= self.deferrals[message_id]
                defer = not capped and self.rng.random() < self.faults.defer_rate
            delay = 0.0
            if hold is not None:
                delay = hold.seconds
            elif self.rng.random() < self.faults.slow_rate:
                delay = self.rng.uniform(self.faults.slow_min, self.faults.slow_max)
                self.counts["slow_replies"] += 1
            if defer:
                self.counts["deferred_451"] += 1
                self.deferrals[message_id] += 1
                self.in_data[port] = InData("data", message_id, recipient)
            else:
                # Committed before the reply, as a real MTA queues before it answers 250.
                self.accepted.append(Accepted(message_id, recipient, time.time()))
                index = len(self.accepted) - 1
                self.in_data[port] = InData("committed", message_id, recipient, index)
        if hold is not None:
            hold.peer_port, hold.message_id = port, message_id
            hold.reached.set()
        if delay:
            await asyncio.sleep(delay)
        if defer:
            with self.lock:
                self.in_data.pop(port, None)
            return "451 4.3.0 Temporary failure, please try again later"
        return "250 2.0.0 Message accepted for delivery"

    async def handle_QUIT(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.lock:
            ended = self.in_data.pop(_client_port(session), None)
            if ended is not None and ended.state == "committed":
                self.endings[ended.accepted] = "quit"
        return "221 Bye"

    def connection_lost(self, port: int) -> None:
        with self.lock:
            lost = self.in_data.pop(port, None)
            if lost is not None and lost.state == "committed":
                self.cuts.append((time.time(), lost))
                self.endings[lost.accepted] = "cut"


class _TrackingSMTP(SMTP):
    """aiosmtpd's SMTP, telling the handler when a client goes away."""

    def connection_lost(self, error: Exception | None) -> None:
        handler = self.event_handler
        if isinstance(handler, FaultyHandler) and self.session is not None:
            handler.connection_lost(_client_port(self.session))
        super().connection_lost(error)


class _Controller(Controller):
    def factory(self) -> SMTP:
        return _TrackingSMTP(self.handler, **self.SMTP_kwargs)


class FaultySmtpServer:
    def __init__(self, faults: SmtpFaults, seed: int) -> None:
        self.port = free_port()
        self.handler = FaultyHandler(faults, seed)
        self._controller = _Controller(self.handler, hostname=HOST, port=self.port)

    def start(self) -> FaultySmtpServer:
        self._controller.start()
        return self

    def stop(self) -> None:
        self._controller.stop()

    def summary(self) -> dict[str, Any]:
        with self.handler.lock:
            counts = dict(self.handler.counts)
            accepted = len(self.handler.accepted)
        attempts = counts.get("data_attempts", 0)
        return {
            **counts,
            "accepted": accepted,
            "deferred_ratio": round(counts.get("deferred_451", 0) / attempts, 3) if attempts else 0,
            "faults": {
                "defer_rate": self.handler.faults.defer_rate,
                "max_deferrals_per_message": self.handler.faults.max_deferrals,
                "slow_rate": self.handler.faults.slow_rate,
                "slow_seconds": [self.handler.faults.slow_min, self.handler.faults.slow_max],
                "refused_domain": self.handler.faults.refused_domain,
            },
        }
