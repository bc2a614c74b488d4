"""Client addresses of a test's own, so that per-address counts of other tests never meet it."""

from __future__ import annotations

import secrets


def an_address() -> str:
    """An address of this test's own: counters from other tests never meet it."""
    return f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(254) + 1}"


def a_loopback_address() -> str:
    """A loopback address of this test's own to connect from (Linux routes all of 127.0.0.0/8
    to the loopback interface): never 127.0.0.1, where the tests' trusted proxy sends from."""
    return f"127.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(253) + 2}"
