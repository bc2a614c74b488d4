"""stack.smtp: each fault of the one SMTP server, as a real client (smtplib) meets it, and the
record it keeps: committed before the reply, every session's end, counts that add up under
concurrent clients."""

from __future__ import annotations

import smtplib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.message import EmailMessage

import pytest

from stack.net import HOST, wait_until
from stack.smtp import IN_WINDOW, OUTSIDE, Faults, SmtpServer
from tests.helpers.source import TOOLS, imported_modules, python_files


@pytest.fixture
def server() -> Iterator[SmtpServer]:
    with SmtpServer(seed=7) as running:
        yield running


def message(to: str = "ada@example.com", number: int = 1) -> EmailMessage:
    email = EmailMessage()
    email["From"] = "billing@example.com"
    email["To"] = to
    email["Subject"] = f"Invoice {number}"
    email["Message-ID"] = f"<in_{number}.abc@example.com>"
    email.set_content(f"Invoice {number} is paid.\n")
    return email


def send(server: SmtpServer, email: EmailMessage, **options: object) -> None:
    with smtplib.SMTP(HOST, server.port, timeout=10) as client:
        client.send_message(email, **options)  # type: ignore[arg-type]


def test_every_message_is_recorded_as_the_client_gave_it(server: SmtpServer) -> None:
    before = time.time()
    send(server, message("Ada@Example.com", 42))
    [received] = server.handler.received()
    assert received.mail_from == "billing@example.com"
    assert received.rcpt_tos == ["Ada@Example.com"]
    assert received.recipient == "ada@example.com"
    assert received.message_id == "<in_42.abc@example.com>"
    assert received.smtputf8 is False
    assert before <= received.at <= time.time()
    assert received.peer == HOST  # the client's address (across hosts: which host sent it)
    assert b"Invoice 42 is paid." in received.content
    [parsed] = server.messages
    assert (parsed["Subject"], parsed["Message-ID"]) == ("Invoice 42", "<in_42.abc@example.com>")
    assert server.handler.attempts == 1


def test_refused_recipients_and_domains_get_a_550_at_rcpt(server: SmtpServer) -> None:
    server.handler.faults.refuse = {"typo@exmaple.com"}
    server.handler.faults.refuse_domain = "refused.example.com"
    for address in ("Typo@Exmaple.com", "anyone@refused.example.com"):
        with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
            send(server, message(address))
        [(code, reply)] = refused.value.recipients.values()
        assert code == 550
        assert reply == b"5.1.1 mailbox unavailable"
    send(server, message("fine@example.com"))
    assert [r.recipient for r in server.handler.received()] == ["fine@example.com"]
    assert server.handler.counts["refused_at_rcpt"] == 2
    assert server.handler.attempts == 1  # the refused never reached DATA


def test_scripted_replies_come_one_per_data_then_always(server: SmtpServer) -> None:
    server.handler.faults.replies = ["451 4.3.0 try again later", "452 4.3.1 no room"]
    server.handler.faults.always = "554 5.7.1 rejected"
    codes = []
    for number in range(4):
        with pytest.raises(smtplib.SMTPDataError) as refused:
            send(server, message(number=number))
        codes.append(refused.value.smtp_code)
    assert codes == [451, 452, 554, 554]
    server.handler.faults.always = None
    send(server, message(number=9))
    assert [r.message_id for r in server.handler.received()] == ["<in_9.abc@example.com>"]
    assert server.handler.attempts == 5


def test_a_share_of_data_is_deferred_each_message_at_most_so_often() -> None:
    with SmtpServer(faults=Faults(defer_rate=1.0, max_deferrals=2)) as server:
        outcomes = []
        for _ in range(3):
            try:
                send(server, message(number=1))
                outcomes.append(250)
            except smtplib.SMTPDataError as deferred:
                outcomes.append(deferred.smtp_code)
        assert outcomes == [451, 451, 250]  # capped: the third attempt goes through
        with pytest.raises(smtplib.SMTPDataError):
            send(server, message(number=2))  # another message has its own count
        assert server.handler.counts["deferred_451"] == 3
        assert len(server.handler.received()) == 1


def test_a_delayed_reply_is_committed_first_and_delays_no_other_session() -> None:
    with SmtpServer(faults=Faults(delay=1.0)) as server:
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            # Committed while the clients still wait for their 250.
            sending = [pool.submit(send, server, message(number=n)) for n in range(4)]
            assert server.handler.wait_for(4, timeout=0.9)
            assert not any(future.done() for future in sending)
            for future in sending:
                future.result()
        elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 1.9  # side by side, not 4 x 1 s one after the other
    assert server.handler.counts["slow_replies"] == 4


def test_a_delay_range_and_share_draw_from_the_servers_seeded_stream() -> None:
    faults = Faults(delay=0.2, delay_max=0.4, delay_share=0.5)
    with SmtpServer(faults=faults, seed=1) as server:
        times = []
        for number in range(12):
            started = time.monotonic()
            send(server, message(number=number))
            times.append(time.monotonic() - started)
    slow = [t for t in times if t >= 0.2]
    assert server.handler.counts["slow_replies"] == len(slow)
    assert 0 < len(slow) < 12  # some, not all
    assert all(t < 0.4 + 0.3 for t in slow)


def test_down_closes_every_connection_before_the_greeting_until_it_is_up() -> None:
    with SmtpServer(faults=Faults(down=True)) as server:
        for _ in range(3):
            with pytest.raises(smtplib.SMTPServerDisconnected):
                send(server, message())
        assert len(server.handler.down_connections) == 3
        assert server.handler.attempts == 0
        server.handler.faults.down = False
        send(server, message())
        assert len(server.handler.received()) == 1
        assert len(server.handler.down_connections) == 3


def test_stopped_it_refuses_connections(server: SmtpServer) -> None:
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        send(server, message())


def test_smtputf8_is_offered_only_when_asked_for() -> None:
    with SmtpServer(smtputf8=True) as utf8, SmtpServer() as ascii_only:
        for server, offered in ((utf8, True), (ascii_only, False)):
            with smtplib.SMTP(HOST, server.port, timeout=10) as client:
                client.ehlo()
                assert client.has_extn("smtputf8") is offered
        email = message("jénny@example.com")
        send(utf8, email)
        [received] = utf8.handler.received()
        assert received.smtputf8 is True
        assert received.rcpt_tos == ["jénny@example.com"]
        assert utf8.messages[0]["To"] == "jénny@example.com"
        with pytest.raises(smtplib.SMTPNotSupportedError):
            send(ascii_only, email)


def test_a_hold_in_the_window_is_committed_and_one_outside_is_answered_451(
    server: SmtpServer,
) -> None:
    held = server.handler.hold_next(IN_WINDOW, 0.5)
    client = threading.Thread(target=send, args=(server, message(number=1)))
    client.start()
    assert held.reached.wait(10)
    assert held.message_id == "<in_1.abc@example.com>"
    [(port, session)] = server.handler.sessions_in_data().items()
    assert (port, session.state) == (held.peer_port, "committed")
    client.join(10)
    assert len(server.handler.received()) == 1

    outside = server.handler.hold_next(OUTSIDE, 0.2)
    with pytest.raises(smtplib.SMTPDataError) as deferred:
        send(server, message(number=2))
    assert outside.reached.is_set()
    assert deferred.value.smtp_code == 451
    assert len(server.handler.received()) == 1  # nothing committed


def raw_send_then_vanish(port: int, number: int) -> None:
    """Send one message and close the socket without reading the reply to DATA."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        reader = sock.makefile("rb")
        reader.readline()  # greeting
        for command in (
            b"HELO client",
            b"MAIL FROM:<billing@example.com>",
            b"RCPT TO:<ada@example.com>",
            b"DATA",
        ):
            sock.sendall(command + b"\r\n")
            reader.readline()
        sock.sendall(message(number=number).as_bytes().replace(b"\n", b"\r\n") + b"\r\n.\r\n")


def test_a_session_cut_after_its_commit_is_recorded_as_a_cut(server: SmtpServer) -> None:
    server.handler.faults.delay = 1.0
    raw_send_then_vanish(server.port, 1)
    assert wait_until(lambda: server.handler.cuts, timeout=10)
    server.handler.faults.delay = 0
    send(server, message(number=2))
    [(_, cut)] = server.handler.cuts
    assert (cut.state, cut.message_id, cut.accepted) == ("committed", "<in_1.abc@example.com>", 0)
    assert server.handler.endings == {0: "cut", 1: "quit"}
    assert len(server.handler.received()) == 2  # the vanished client still delivered


def test_counts_and_record_add_up_under_concurrent_clients() -> None:
    with SmtpServer(faults=Faults(defer_rate=0.3), seed=3) as server:
        outcomes: list[int] = []
        lock = threading.Lock()

        def client(base: int) -> None:
            for number in range(base, base + 10):
                try:
                    send(server, message(number=number))
                    code = 250
                except smtplib.SMTPDataError as deferred:
                    code = deferred.smtp_code
                with lock:
                    outcomes.append(code)

        threads = [threading.Thread(target=client, args=(n * 100,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        handler = server.handler
        assert len(outcomes) == handler.attempts == 80
        assert outcomes.count(451) == handler.counts["deferred_451"] > 0
        assert outcomes.count(250) == len(handler.received())
        assert len({r.message_id for r in handler.received()}) == outcomes.count(250)


def test_this_is_the_one_smtp_server_of_the_tools() -> None:
    servers = {
        path
        for path in python_files(*TOOLS)
        for _, module in imported_modules(path)
        if module.split(".")[0] == "aiosmtpd"
    }
    assert servers == {"stack/smtp.py"}
