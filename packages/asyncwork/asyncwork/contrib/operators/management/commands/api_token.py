"""``manage.py api_token create|revoke USERNAME``: API tokens from the command line.

``create`` prints the token alone on standard output (``TOKEN=$(manage.py api_token create ops)``)
and when it expires on standard error; it is not stored, so it cannot be shown again. ``--hours``
may not exceed ``API_TOKEN_MAX_HOURS``. Both actions are recorded as operator actions of
``cli:<--actor, else the login name>``. A stored username is printed through ``printable``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from asyncwork.audit import cli_actor, cli_actor_argument
from asyncwork.contrib.operators.tokens import TokenRefused, api_token_create, api_token_revoke
from asyncwork.logging import printable
from asyncwork.settings import asyncwork_settings


class Command(BaseCommand):
    help = "Issue or revoke API tokens (sent as: Authorization: Token <token>)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        create = sub.add_parser("create", help="Issue a token for USERNAME and print it once.")
        create.add_argument("username")
        create.add_argument(
            "--hours",
            type=int,
            default=None,
            help=f"Lifetime in hours (default: API_TOKEN_TTL_HOURS, "
            f"{asyncwork_settings.API_TOKEN_TTL_HOURS}; at most API_TOKEN_MAX_HOURS, "
            f"{asyncwork_settings.API_TOKEN_MAX_HOURS}).",
        )
        cli_actor_argument(create)
        revoke = sub.add_parser("revoke", help="Delete every token of USERNAME.")
        revoke.add_argument("username")
        cli_actor_argument(revoke)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            getattr(self, f"_{options['action']}")(options)
        except TokenRefused as exc:
            raise CommandError(printable(str(exc))) from exc

    def _create(self, options: dict[str, Any]) -> None:
        hours = options["hours"]
        if hours is not None and hours < 1:
            raise CommandError("--hours must be at least 1")
        issued = api_token_create(
            username=options["username"],
            actor=cli_actor(options["actor"]),
            ttl=None if hours is None else timedelta(hours=hours),
        )
        self.stdout.write(issued.token)
        self.stderr.write(
            f"token for {printable(issued.user.get_username())} expires at "
            f"{issued.expiry:%Y-%m-%d %H:%M:%S %Z}; it is shown only now"
        )

    def _revoke(self, options: dict[str, Any]) -> None:
        deleted = api_token_revoke(username=options["username"], actor=cli_actor(options["actor"]))
        self.stdout.write(self.style.SUCCESS(f"revoked {deleted} token(s)"))
