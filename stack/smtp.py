"""A real SMTP server (aiosmtpd, on a thread of the caller's process) with one fault model, and
its record of every message it took.

The faults (``Faults``, read at each command, so they can change while it runs):

* **refuse**: recipients (``refuse``) or every recipient of a domain (``refuse_domain``) are
  answered ``550 5.1.1`` at RCPT, a permanent refusal;
* **defer**: scripted replies to the next DATA commands, one each (``replies``, e.g. ``451
  4.3.0 ...``, or a 5xx), then ``always`` for every DATA, then a random share ``defer_rate``
  answered ``451 4.3.0``, each Message-ID at most ``max_deferrals`` times (0: no cap);
* **delay**: a share ``delay_share`` of DATA replies waits ``delay`` seconds (uniform up to
  ``delay_max`` when that is larger). The wait is awaited: other sessions carry on, as with
  a slow provider, which answers everyone slowly rather than one after another;
* **down**: every connection is accepted and closed before the greeting, like an MTA that is
  down behind its address (each one counted); refused connections are what ``free_port``
  gives;
* **hold** (``Handler.hold_next``): the next DATA is held for a few seconds, committed
  (``IN_WINDOW``: the message is taken, the 250 not yet sent) or not (``OUTSIDE``: it will
  be answered 451), so a caller can kill the client inside it.

The record. A message is committed (``Handler.envelopes``) once the server decides to take
it, before its reply is delayed or sent, as a real MTA queues a message before it says 250:
a client that dies before it reads the 250 has still delivered it. A client that keeps its
connection for the next message ends the message with RSET (or its next MAIL); sessions that
end without QUIT, RSET or MAIL after a commit are recorded as ``cuts``. Every count
(``Handler.counts``) and the record are kept under one lock; ``wait_for`` blocks until a
number of messages is in.

With ``smtputf8`` the server offers SMTPUTF8 (RFC 6531); without it, aiosmtpd refuses the
parameter and any non-ASCII byte in a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import email.policy
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from email.message import EmailMessage
from functools import cached_property
from types import TracebackType
from typing import cast

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from stack.net import HOST, free_port

IN_WINDOW = "in_window"
OUTSIDE = "outside"
DEFERRED = "451 4.3.0 Temporary failure, please try again later"
ACCEPTED = "250 2.0.0 Message accepted for delivery"

_MESSAGE_ID = re.compile(rb"^Message-ID:[ \t]*(<[^>\r\n]*>)", re.IGNORECASE | re.MULTILINE)


@dataclass
class Faults:
    """What the server does to the commands it is sent (see the module's docstring)."""

    refuse: set[str] = field(default_factory=set)
    refuse_domain: str = ""
    replies: list[str] = field(default_factory=list)
    always: str | None = None
    defer_rate: float = 0.0
    max_deferrals: int = 0
    delay: float = 0.0
    delay_max: float = 0.0
    delay_share: float = 1.0
    down: bool = False

    def refuses(self, address: str) -> bool:
        address = address.lower()
        domain = self.refuse_domain.lower()
        return address in {a.lower() for a in self.refuse} or (
            bool(domain) and address.endswith("@" + domain)
        )


@dataclass(frozen=True)
class Received:
    """One committed message, as the client gave it."""

    mail_from: str
    rcpt_tos: list[str]
    smtputf8: bool  # MAIL FROM carried the SMTPUTF8 parameter
    content: bytes
    message_id: str
    at: float  # time.time() of the commit
    peer: str = ""  # the client's address

    @property
    def recipient(self) -> str:
        """The first recipient, lower case."""
        return (self.rcpt_tos or [""])[0].lower()

    @cached_property
    def message(self) -> EmailMessage:
        """The message parsed (once). An SMTPUTF8 message may carry UTF-8 in its header
        fields (RFC 6532), which a bytes parser would leave as surrogate escapes; its body
        stays bytes, as MIME has it."""
        if self.smtputf8:
            head, blank, body = self.content.partition(b"\r\n\r\n")
            text = head.decode() + blank.decode() + body.decode("ascii", "surrogateescape")
            parsed = email.message_from_string(text, policy=email.policy.default)
        else:
            parsed = email.message_from_bytes(self.content, policy=email.policy.default)
        return cast(EmailMessage, parsed)  # policy.default makes EmailMessage


@dataclass(frozen=True)
class InData:
    """A session inside DATA: ``data`` (not decided yet, or about to be answered 451) or
    ``committed`` (``accepted`` is its index in the record; the client has not quit yet)."""

    state: str
    message_id: str
    recipient: str
    accepted: int = -1
    port: int = 0  # the client's end of the session
    peer: str = ""  # the client's address


@dataclass
class Hold:
    """A request to hold the next DATA for ``seconds``; ``reached`` is set once a session is
    held, with its client's port and the message's Message-ID."""

    kind: str  # IN_WINDOW or OUTSIDE
    seconds: float
    reached: threading.Event = field(default_factory=threading.Event)
    peer_port: int = 0
    message_id: str = ""
    peer: str = ""  # the client's address


def _client_port(session: Session | None) -> int:
    peer = session.peer if session is not None else None
    return int(peer[1]) if isinstance(peer, tuple) else 0


def _client_address(session: Session | None) -> str:
    peer = session.peer if session is not None else None
    return str(peer[0]) if isinstance(peer, tuple) else ""


class Handler:
    """aiosmtpd's handler: applies the faults, keeps the record."""

    def __init__(self, faults: Faults, seed: int | None = None) -> None:
        self.faults = faults
        self.rng = random.Random(seed)  # noqa: S311 - fault injection, not secrets
        self.lock = threading.Lock()
        self._received = threading.Condition(self.lock)
        self.envelopes: list[Received] = []
        self.counts: Counter[str] = Counter()
        self.deferrals: Counter[str] = Counter()  # by Message-ID, from defer_rate
        self.down_connections: list[float] = []  # time.time() of each connection cut by down
        self.cuts: list[tuple[float, InData]] = []  # sessions lost after their commit
        self.endings: dict[int, str] = {}  # index in envelopes -> "quit", "rset" or "cut"
        self.in_data: dict[int, InData] = {}  # client port -> its session inside DATA
        self.serving = False  # start()'s own check connection is never cut
        self._hold: Hold | None = None

    # --- what a caller reads and asks -----------------------------------------------------------

    @property
    def attempts(self) -> int:
        """DATA commands received."""
        with self.lock:
            return self.counts["data_attempts"]

    def received(self) -> list[Received]:
        with self.lock:
            return list(self.envelopes)

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` messages in all are committed; False if not within
        ``timeout`` seconds."""
        with self._received:
            return self._received.wait_for(lambda: len(self.envelopes) >= count, timeout)

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

    # --- SMTP hooks -----------------------------------------------------------------------------

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if self.faults.refuses(address):
            with self.lock:
                self.counts["refused_at_rcpt"] += 1
            return "550 5.1.1 mailbox unavailable"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        content = envelope.original_content or b""
        found = _MESSAGE_ID.search(content.partition(b"\r\n\r\n")[0])
        message_id = found.group(1).decode("ascii", "replace") if found else ""
        recipient = (envelope.rcpt_tos or [""])[0].lower()
        port = _client_port(session)
        peer = _client_address(session)
        faults = self.faults
        with self.lock:
            self.counts["data_attempts"] += 1
            hold, self._hold = self._hold, None
            reply = faults.replies.pop(0) if faults.replies else faults.always
            if reply is None and hold is not None and hold.kind == OUTSIDE:
                reply = DEFERRED
            elif reply is None and hold is None and faults.defer_rate > 0:
                capped = 0 < faults.max_deferrals <= self.deferrals[message_id]
                if not capped and self.rng.random() < faults.defer_rate:
                    reply = DEFERRED
            delay = hold.seconds if hold is not None else self._delay()
            if reply == DEFERRED:
                self.counts["deferred_451"] += 1
                self.deferrals[message_id] += 1
            if reply is None:
                # Committed before the reply, as a real MTA queues before it answers 250.
                self.envelopes.append(
                    Received(
                        mail_from=str(envelope.mail_from),
                        rcpt_tos=list(envelope.rcpt_tos),
                        smtputf8=envelope.smtp_utf8,
                        content=content,
                        message_id=message_id,
                        at=time.time(),
                        peer=peer,
                    )
                )
                self.in_data[port] = InData(
                    "committed", message_id, recipient, len(self.envelopes) - 1, port, peer
                )
                self._received.notify_all()
            else:
                self.in_data[port] = InData("data", message_id, recipient, port=port, peer=peer)
        if hold is not None:
            hold.peer_port, hold.message_id, hold.peer = port, message_id, peer
            hold.reached.set()
        if delay > 0:
            await asyncio.sleep(delay)
        if reply is not None:
            with self.lock:
                self.in_data.pop(port, None)
            return reply
        return ACCEPTED

    def _delay(self) -> float:
        """Seconds to hold this DATA's reply (called under the lock: one random stream)."""
        faults = self.faults
        if faults.delay <= 0 or faults.delay_share <= 0:
            return 0.0
        if faults.delay_share < 1 and self.rng.random() >= faults.delay_share:
            return 0.0
        self.counts["slow_replies"] += 1
        if faults.delay_max > faults.delay:
            return self.rng.uniform(faults.delay, faults.delay_max)
        return faults.delay

    def _ended(self, session: Session, how: str) -> None:
        """The client has read the reply to its last DATA: that message is out of the window."""
        with self.lock:
            ended = self.in_data.pop(_client_port(session), None)
            if ended is not None and ended.state == "committed":
                self.endings[ended.accepted] = how

    async def handle_QUIT(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self._ended(session, "quit")
        return "221 Bye"

    async def handle_RSET(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self._ended(session, "rset")
        return "250 OK"

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        self._ended(session, "rset")
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 OK"

    # --- connections ----------------------------------------------------------------------------

    def connection_cut(self) -> bool:
        """A new connection: True if the server is down and it is to be closed at once."""
        if not (self.serving and self.faults.down):
            return False
        with self.lock:
            self.counts["down_connections"] += 1
            self.down_connections.append(time.time())
        return True

    def connection_lost(self, port: int) -> None:
        with self.lock:
            lost = self.in_data.pop(port, None)
            if lost is not None and lost.state == "committed":
                self.cuts.append((time.time(), lost))
                self.endings[lost.accepted] = "cut"


class _SMTP(SMTP):
    """aiosmtpd's SMTP, with the connection faults and the end of each session told to the
    handler."""

    _cut = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        handler = self.event_handler
        if isinstance(handler, Handler) and handler.connection_cut():
            self._cut = True
            transport.close()
            return
        if isinstance(handler, Handler) and handler.serving:  # not start()'s own check
            with handler.lock:
                handler.counts["sessions"] += 1
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        if self._cut:
            return
        handler = self.event_handler
        if isinstance(handler, Handler):
            handler.connection_lost(_client_port(self.session))
        super().connection_lost(error)


class _Controller(Controller):
    def factory(self) -> SMTP:
        return _SMTP(self.handler, **self.SMTP_kwargs)


class SmtpServer:
    """The server on ``host``:``port`` (``HOST`` and a free port unless given), in a thread of
    its own. ``start()`` returns once it answers; ``stop()`` closes it (refused connections
    after). On another host (``stack.netns``), ``start()`` it inside that host's namespace:
    its thread, and so its socket, are born there."""

    def __init__(
        self,
        port: int | None = None,
        *,
        faults: Faults | None = None,
        smtputf8: bool = False,
        seed: int | None = None,
        host: str = HOST,
    ) -> None:
        self.host = host
        self.handler = Handler(faults or Faults(), seed)
        self.smtputf8 = smtputf8
        self._fixed_port = port
        self.port = port or 0
        self._controller: Controller | None = None

    @property
    def messages(self) -> list[EmailMessage]:
        """Every committed message, parsed."""
        return [received.message for received in self.handler.received()]

    def start(self) -> SmtpServer:
        error: Exception | None = None
        # A free port may be taken by someone else before the server binds it: try others.
        for _ in range(1 if self._fixed_port else 5):
            port = self._fixed_port or free_port(self.host)
            controller = _Controller(
                self.handler, hostname=self.host, port=port, enable_SMTPUTF8=self.smtputf8
            )
            try:
                controller.start()
            except (OSError, RuntimeError) as exc:  # a failed bind, as aiosmtpd reports it
                error = exc
                continue
            self._controller, self.port = controller, port
            self.handler.serving = True
            return self
        raise RuntimeError(f"the SMTP server could not start: {error!r}") from error

    def stop(self) -> None:
        self.handler.serving = False
        if self._controller is not None:
            with contextlib.suppress(Exception):  # stopping twice, or a loop already closed
                self._controller.stop()
            self._controller = None

    def __enter__(self) -> SmtpServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
