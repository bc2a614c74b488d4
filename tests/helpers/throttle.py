"""Counting windows of the webhook throttle without meeting other tests' counts."""

from __future__ import annotations

import secrets
import time


def an_address() -> str:
    """An address of this test's own: counters from other tests never meet it."""
    return f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(254) + 1}"


def fresh_window(seconds: int = 60, margin: float = 3.0) -> None:
    """Start the test clear of a window boundary, so the window does not roll over mid-test."""
    left = seconds - time.time() % seconds
    if left < margin:
        time.sleep(left + 0.05)


def a_loopback_address() -> str:
    """A loopback address of this test's own to connect from (Linux routes all of 127.0.0.0/8
    to the loopback interface): never 127.0.0.1, where the tests' trusted proxy sends from."""
    return f"127.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(253) + 2}"
