"""stack.net: a free port is one nothing listens on, and wait_until hands back what the
condition returned, or False once the time is up."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from stack.net import HOST, free_port, wait_until
from tests.helpers.source import TOOLS, functions_defined, python_files


def test_a_free_port_refuses_connections_and_can_be_bound() -> None:
    port = free_port()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=2).close()
    with socket.socket() as sock:
        sock.bind((HOST, port))


def test_wait_until_returns_the_first_true_value() -> None:
    values = iter([None, 0, "", "done"])
    assert wait_until(lambda: next(values), timeout=5, interval=0.01) == "done"


def test_wait_until_gives_up_with_false_after_the_timeout() -> None:
    started = time.monotonic()
    assert wait_until(lambda: 0, timeout=0.3, interval=0.05) is False
    assert 0.3 <= time.monotonic() - started < 2


def test_wait_until_looks_once_more_at_the_deadline() -> None:
    deadline = time.monotonic() + 0.2
    # Never true while polled at 1 s intervals, true by the final look.
    assert wait_until(lambda: time.monotonic() >= deadline, timeout=0.2, interval=1) is True


def test_wait_until_counts_ignored_exceptions_as_not_yet_and_lets_others_through() -> None:
    calls: Iterator[type[ConnectionError] | str] = iter([ConnectionError, ConnectionError, "up"])

    def probe() -> str:
        value = next(calls)
        if isinstance(value, type):
            raise value("starting")
        return value

    assert wait_until(probe, timeout=5, interval=0.01, ignore=(ConnectionError,)) == "up"

    def down() -> bool:
        raise ConnectionError("still down")

    assert wait_until(down, timeout=0.2, interval=0.05, ignore=(ConnectionError,)) is False
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, timeout=1, ignore=(ConnectionError,))


def test_there_is_one_free_port_and_one_wait_until() -> None:
    found = [
        (path, line, name)
        for path in python_files(*TOOLS)
        for line, name in functions_defined(path)
        if name in {"free_port", "closed_port", "wait_until", "wait_for_port"}
    ]
    assert {(path, name) for path, _, name in found} == {
        ("stack/net.py", "free_port"),
        ("stack/net.py", "wait_until"),
    }, found
