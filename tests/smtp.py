"""A real SMTP server (aiosmtpd) in the test process, with faults on demand, offering the
SMTPUTF8 extension (RFC 6531) or not."""

from __future__ import annotations

import email
import email.policy
import socket
import threading
import time
from dataclasses import dataclass, field
from email.message import EmailMessage

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Faults:
    """What the server does to the next DATA commands."""

    replies: list[str] = field(default_factory=list)  # consumed one per message, e.g. "451 ..."
    always: str | None = None  # answer every message with this
    refuse: set[str] = field(default_factory=set)  # recipients answered 550 at RCPT
    delay: float = 0.0  # seconds before answering DATA


@dataclass(frozen=True)
class Received:
    """The envelope of one accepted message, as the client gave it."""

    mail_from: str
    rcpt_tos: list[str]
    smtputf8: bool  # MAIL FROM carried the SMTPUTF8 parameter
    content: bytes  # the message as received


class Handler:
    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
        self.envelopes: list[Received] = []
        self.attempts = 0
        self.faults = Faults()
        self.lock = threading.Lock()
        self.received = threading.Condition(self.lock)

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        if address.lower() in self.faults.refuse:
            return "550 5.1.1 mailbox unavailable"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.lock:
            self.attempts += 1
            reply = self.faults.replies.pop(0) if self.faults.replies else self.faults.always
        if self.faults.delay:
            time.sleep(self.faults.delay)  # blocks this server's loop, like a slow server
        if reply:
            return reply
        content = envelope.content
        assert isinstance(content, bytes)
        if envelope.smtp_utf8:
            # An SMTPUTF8 message may carry UTF-8 in its header fields (RFC 6532); parsed as
            # bytes they would be left as surrogate escapes. The body stays bytes, as MIME has it.
            head, blank, body = content.partition(b"\r\n\r\n")
            text = head.decode() + blank.decode() + body.decode("ascii", "surrogateescape")
            message = email.message_from_string(text, policy=email.policy.default)
        else:
            message = email.message_from_bytes(content, policy=email.policy.default)
        with self.received:
            self.messages.append(message)  # type: ignore[arg-type]
            self.envelopes.append(
                Received(
                    mail_from=str(envelope.mail_from),
                    rcpt_tos=list(envelope.rcpt_tos),
                    smtputf8=envelope.smtp_utf8,
                    content=content,
                )
            )
            self.received.notify_all()
        return "250 Message accepted"

    def wait_for(self, count: int, timeout: float) -> list[EmailMessage]:
        with self.received:
            self.received.wait_for(lambda: len(self.messages) >= count, timeout=timeout)
            return list(self.messages)


class SmtpServer:
    def __init__(self, port: int | None = None, *, smtputf8: bool = False) -> None:
        self.port = port or free_port()
        self.handler = Handler()
        # Without SMTPUTF8, aiosmtpd neither advertises it nor accepts it in MAIL FROM (501),
        # and refuses any non-ASCII byte in a command ("500 Error: strict ASCII mode").
        self.controller = Controller(
            self.handler, hostname="127.0.0.1", port=self.port, enable_SMTPUTF8=smtputf8
        )

    def start(self) -> SmtpServer:
        self.controller.start()
        return self

    def stop(self) -> None:
        self.controller.stop()

    @property
    def messages(self) -> list[EmailMessage]:
        return list(self.handler.messages)
