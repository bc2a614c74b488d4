"""The operator audit trail, written by the service that acts, inside its transaction: the
admin, the API and the command line share one code path, and only a committed action has a row.
"""

from __future__ import annotations

import argparse
import getpass
import os
from typing import Any

from django.contrib.contenttypes.models import ContentType
from django.db import connection, models

from operators.models import OperatorAction


def operator_action_record(
    *,
    action: str,
    actor: str,
    target: models.Model,
    detail: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> OperatorAction:
    """Record that ``actor`` did ``action`` to ``target``. Refuses to run outside a transaction
    or without an actor."""
    if not actor:
        raise ValueError("an operator action needs an actor")
    if not connection.in_atomic_block:
        raise RuntimeError("record an operator action inside the transaction that performs it")
    return OperatorAction.objects.create(
        action=action,
        actor=actor[:150],
        target_type=ContentType.objects.get_for_model(target),
        target_id=str(target.pk),
        target_label=str(target)[:255],
        before=before,
        after=after,
        detail=detail[:500],
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
