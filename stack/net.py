"""Ports and waiting: the one ``free_port`` and the one ``wait_until`` of the tools around
the application.

``free_port`` binds port 0 and closes the socket: the port is free now, not reserved, so a
caller that can bind the socket itself and hand it over (``launch.gunicorn``) does that
instead. ``wait_until`` polls a condition and hands back what it returned, so the caller
decides what a timeout means (an assertion, an exception with a log, an exit).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Literal, TypeVar

HOST = "127.0.0.1"

T = TypeVar("T")


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on now (bound, then closed: until someone
    binds it, connections to it are refused). Another host's address (``stack.netns``) is
    bound from inside that host's namespace."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.1,
    *,
    ignore: tuple[type[BaseException], ...] = (),
) -> T | Literal[False]:
    """Call ``predicate`` every ``interval`` seconds until it returns something true, and
    return that; after ``timeout`` seconds, call it once more and return what it says then
    (False if it still raises). Exceptions of the types in ``ignore`` count as not yet (a
    service still starting); any other propagates."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(*ignore):
            value = predicate()
            if value:
                return value
        time.sleep(interval)
    with contextlib.suppress(*ignore):
        return predicate() or False
    return False
