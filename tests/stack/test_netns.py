"""stack.netns against real sockets: a cut host and a host cut off from one service see silence
(a connect times out, an established connection stalls with nothing answered), never an
error; healing restores both; a service cut leaves the host's other services reachable; a
RabbitMQ node started inside a host on a service's address answers the other hosts and is
silent to one cut off from it; and nothing of a run is left behind after it, whether it ended
normally or by an exception.

Skipped where namespaces cannot be made (not root, or ``ip netns`` not permitted)."""

from __future__ import annotations

import contextlib
import ipaddress
import smtplib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack import netns
from stack.netns import Topology
from stack.rabbitmq import RabbitNode
from stack.smtp import SmtpServer

_WHY_NOT = netns.available()
pytestmark = [pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or ""), pytest.mark.slow]

PORT = 7000


@contextlib.contextmanager
def _echo(net: Topology, host: str, address: str) -> Iterator[None]:
    """An echo server on ``address``:PORT inside ``host``, on a thread of this process."""
    with net.inside(host):
        listener = socket.create_server((address, PORT))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(1024):
                conn.sendall(data)

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()


def _connect(net: Topology, host: str, address: str, timeout: float = 1.5) -> socket.socket:
    with net.inside(host):
        return socket.create_connection((address, PORT), timeout=timeout)


def _echoes(sock: socket.socket) -> bool:
    sock.sendall(b"ping")
    return sock.recv(4) == b"ping"


@pytest.fixture
def net() -> Iterator[Topology]:
    with Topology(["a", "b", "c"], services={"db": "b", "cache": "b"}) as topology:
        yield topology


def test_hosts_reach_each_other_and_their_services(net: Topology) -> None:
    with _echo(net, "b", net.address("b")), _echo(net, "b", net.service_address("db")):
        for address in (net.address("b"), net.service_address("db")):
            with _connect(net, "a", address) as sock:
                assert _echoes(sock)
    addresses = [net.address(h) for h in net.hosts] + [net.service_address("db")]
    assert all(ipaddress.ip_address(a) in net.subnet for a in addresses)
    assert net.subnet.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))


def test_a_cut_host_is_silent_and_healing_restores_it(net: Topology) -> None:
    with _echo(net, "b", net.address("b")):
        established = _connect(net, "a", net.address("b"))
        assert _echoes(established)
        net.cut("a")
        assert net.is_cut("a")
        started = time.monotonic()
        # A new connection times out (no refusal, no unreachable error) ...
        with pytest.raises(TimeoutError):
            _connect(net, "a", net.address("b"), timeout=1.0)
        assert time.monotonic() - started >= 0.9
        # ... so does a connection from the other side ...
        with pytest.raises(TimeoutError):
            _connect(net, "c", net.address("a"), timeout=1.0)
        # ... and the established one stalls: the send is buffered, nothing comes back.
        established.settimeout(1.0)
        established.sendall(b"ping")
        with pytest.raises(TimeoutError):
            established.recv(4)
        # Other hosts are not affected.
        with _connect(net, "c", net.address("b")) as sock:
            assert _echoes(sock)
        net.heal("a")
        assert not net.is_cut("a")
        # The stalled connection delivers what it held (retransmitted), and new ones work.
        established.settimeout(10)
        assert established.recv(4) == b"ping"
        established.close()
        with _connect(net, "a", net.address("b")) as sock:
            assert _echoes(sock)


def test_a_service_cut_is_silent_for_that_host_and_service_only(net: Topology) -> None:
    db, cache = net.service_address("db"), net.service_address("cache")
    with _echo(net, "b", db), _echo(net, "b", cache), _echo(net, "b", net.address("b")):
        established = _connect(net, "a", db)
        assert _echoes(established)
        net.cut_service("a", "db")
        with pytest.raises(TimeoutError):
            _connect(net, "a", db, timeout=1.0)
        established.settimeout(1.0)
        established.sendall(b"ping")
        with pytest.raises(TimeoutError):
            established.recv(4)
        # The same host reaches the other service and the host itself; another host reaches db.
        for client, address in (("a", cache), ("a", net.address("b")), ("c", db)):
            with _connect(net, client, address) as sock:
                assert _echoes(sock)
        net.heal_service("a", "db")
        established.settimeout(10)
        assert established.recv(4) == b"ping"
        established.close()
        with _connect(net, "a", db) as sock:
            assert _echoes(sock)


def test_a_flapping_link_is_cut_and_healed_in_turn_and_ends_healed(net: Topology) -> None:
    flap = net.flap("a", down=0.3, up=0.3, seconds=1.5)
    time.sleep(0.1)
    assert net.is_cut("a")
    flap.join(5)
    assert len(flap.cuts) >= 2
    assert not net.is_cut("a")
    with _echo(net, "b", net.address("b")), _connect(net, "a", net.address("b")) as sock:
        assert _echoes(sock)


def test_a_server_started_inside_a_host_serves_there_and_names_each_client_host(
    net: Topology,
) -> None:
    smtp = SmtpServer(host=net.address("b"))
    with net.inside("b"):  # its thread, and so its listening socket, are born in b
        smtp.start()
    try:
        for client in ("a", "c"):
            with net.inside(client), smtplib.SMTP(smtp.host, smtp.port, timeout=5) as session:
                session.sendmail(
                    "billing@example.com", ["ada@example.com"], b"Subject: hi\r\n\r\nhi"
                )
        assert [r.peer for r in smtp.handler.received()] == [net.address("a"), net.address("c")]
    finally:
        smtp.stop()


@pytest.mark.slow
def test_a_rabbitmq_node_on_a_host_answers_other_hosts_and_is_silent_when_cut_from_them(
    tmp_path: Path,
) -> None:
    with Topology(["a", "b", "c"], services={"rabbitmq": "b"}) as topology:
        address = topology.service_address("rabbitmq")
        node = RabbitNode(root=tmp_path, address=address, via=topology.argv("b", []))
        try:
            with topology.inside("a"):
                node.start()
                assert node.url == f"amqp://guest:guest@{address}:5672//"
                # rabbitmqctl reaches the node where it runs (epmd on b's own loopback).
                assert node.node in node.ctl("status")
                topology.cut_service("a", "rabbitmq")
                assert not node.answers(1.0)
            with topology.inside("c"):
                assert node.answers(2.0)
            topology.heal_service("a", "rabbitmq")
            with topology.inside("a"):
                assert node.answers(2.0)
        finally:
            node.remove()


def test_a_process_runs_on_its_host() -> None:
    with Topology(["a", "b"]) as topology:
        out = subprocess.run(
            topology.argv("b", ["ip", "-j", "addr", "show", "eth0"]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert topology.address("b") in out
        assert topology.address("a") not in out


def test_a_hosts_file_names_several_hosts_for_what_runs_there_and_goes_with_the_run() -> None:
    with Topology(["a", "b", "c"]) as topology:
        topology.hosts_file("a", {"web": [topology.address("b"), topology.address("c")]})
        resolve = "import socket; print(sorted(socket.gethostbyname_ex('web')[2]))"
        out = subprocess.run(
            topology.argv("a", [sys.executable, "-c", resolve]),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == str(sorted([topology.address("b"), topology.address("c")]))
        prefix = topology.prefix
    assert not list(netns.ETC_NETNS.glob(f"{prefix}-*"))


def test_nothing_is_left_behind_after_a_normal_exit() -> None:
    with Topology(["a", "b"], services={"db": "b"}) as topology:
        prefix = topology.prefix
        assert len(topology.namespaces()) == 3  # the switch and two hosts
        # A process still running on a host is killed with it, not left holding it.
        sleeper = subprocess.Popen(topology.argv("a", ["sleep", "60"]))
        time.sleep(0.3)
    assert not [n for n in netns.namespaces() if n.startswith(prefix)]
    assert sleeper.wait(5) is not None


def test_nothing_is_left_behind_after_an_exception() -> None:
    topology = Topology(["a", "b"])
    prefix = topology.prefix

    def fails() -> None:
        with topology:
            topology.cut("a")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert not [n for n in netns.namespaces() if n.startswith(prefix)]


def test_a_failed_start_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    topology = Topology(["a", "b"])
    real_make = topology._make

    def make_then_fail() -> None:
        real_make()
        raise netns.NetnsError("made to fail")

    monkeypatch.setattr(topology, "_make", make_then_fail)
    with pytest.raises(netns.NetnsError), topology:
        pass
    assert not topology.namespaces()


def test_stale_namespaces_of_a_dead_run_are_removed() -> None:
    # A pid that is surely gone: a child that has been reaped.
    child = subprocess.Popen(["true"])
    child.wait()
    name = f"{netns.FAMILY}-{child.pid}-dead-a"
    netns.ip("netns", "add", name)
    try:
        assert name in netns.stale_remove()
        assert name not in netns.namespaces()
    finally:
        with contextlib.suppress(netns.NetnsError):
            netns.ip("netns", "del", name)


def test_bad_host_names_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Topology(["a", "a"])
    with pytest.raises(ValueError, match="do not exist"):
        Topology(["a"], services={"db": "z"})
