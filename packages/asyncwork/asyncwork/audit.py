"""Operator actions, announced inside the transaction that performs them.

The machinery's services (replay, purge, republish) and the application's own call
``operator_action_record``, which sends ``operator_acted``; an application that keeps an audit
trail connects a receiver that writes its row. A receiver runs in the acting transaction: its row
commits with the action or not at all, and a receiver that raises undoes the action.

The command line's actor is ``cli:<name>``: the ``--actor`` given, else the OS login name.
"""

from __future__ import annotations

import argparse
import getpass
import os
from typing import Any

from django.db import connection, models
from django.dispatch import Signal

# Sent with sender=the target's model and keyword arguments action, actor (``admin:<user>``,
# ``api:<user>`` or ``cli:<name>``), target (the row acted on), detail, before and after (each a
# JSON-able dict or None).
operator_acted = Signal()


def operator_action_record(
    *,
    action: str,
    actor: str,
    target: models.Model,
    detail: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    """Announce that ``actor`` did ``action`` to ``target``. Refuses to run outside a transaction
    or without an actor."""
    if not actor:
        raise ValueError("an operator action needs an actor")
    if not connection.in_atomic_block:
        raise RuntimeError("record an operator action inside the transaction that performs it")
    operator_acted.send(
        sender=type(target),
        action=action,
        actor=actor,
        target=target,
        detail=detail,
        before=before,
        after=after,
    )


ACTOR_NAME_MAX = 100


def _actor_name(value: str) -> str:
    name = value.strip()
    if not name or len(name) > ACTOR_NAME_MAX or not name.isprintable():
        raise argparse.ArgumentTypeError(
            f"give who is acting: 1 to {ACTOR_NAME_MAX} printable characters"
        )
    return name


def cli_actor_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--actor NAME`` to a command (or subcommand) that acts; ``cli_actor`` reads it."""
    parser.add_argument(
        "--actor",
        type=_actor_name,
        metavar="NAME",
        help="Who is acting, for the operator actions' record (default: your login name). "
        "Where everyone runs commands as one account, as in a container, name yourself.",
    )


def cli_actor(name: str | None = None) -> str:
    """``cli:<name>``: the ``--actor`` given, else the OS login name (no terminal needed)."""
    if name is None:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):  # a container's uid with no passwd entry and no $USER
            name = f"uid {os.getuid()}"
    return f"cli:{name}"
