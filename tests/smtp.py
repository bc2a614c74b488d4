"""A real SMTP server (aiosmtpd) in the test process, with faults on demand."""

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


class Handler:
    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
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
        message = email.message_from_bytes(
            envelope.content,
            policy=email.policy.default,  # type: ignore[arg-type]
        )
        with self.received:
            self.messages.append(message)  # type: ignore[arg-type]
            self.received.notify_all()
        return "250 Message accepted"

    def wait_for(self, count: int, timeout: float) -> list[EmailMessage]:
        with self.received:
            self.received.wait_for(lambda: len(self.messages) >= count, timeout=timeout)
            return list(self.messages)


class SmtpServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.handler = Handler()
        self.controller = Controller(self.handler, hostname="127.0.0.1", port=self.port)

    def start(self) -> SmtpServer:
        self.controller.start()
        return self

    def stop(self) -> None:
        self.controller.stop()

    @property
    def messages(self) -> list[EmailMessage]:
        return list(self.handler.messages)
