"""``manage.py dlq list|replay|purge``: the dead-letter queue from the command line.

Replay calls the same service as the admin action and the API, so every replay is one code
path, and replaying a dead letter twice replays it once.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from core.audit import cli_actor
from core.deadletters import dead_letter_purge, dead_letter_replay
from core.models import DeadLetter


def dead_letter_json(letter: DeadLetter) -> dict[str, Any]:
    return {
        "id": letter.pk,
        "task": letter.task,
        "task_id": letter.task_id,
        "args": letter.args,
        "kwargs": letter.kwargs,
        "reason": letter.reason,
        "exception_class": letter.exception_class,
        "exception_message": letter.exception_message,
        "attempts": letter.attempts,
        "first_failed_at": letter.first_failed_at.isoformat(),
        "last_failed_at": letter.last_failed_at.isoformat(),
        "created_at": letter.created_at.isoformat(),
        "replayed_at": letter.replayed_at.isoformat() if letter.replayed_at else None,
        "replayed_by": letter.replayed_by,
    }


class Command(BaseCommand):
    help = "List, replay or purge dead letters."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        listing = sub.add_parser("list", help="List dead letters, newest first.")
        listing.add_argument("--json", action="store_true", help="Print a JSON list.")
        listing.add_argument(
            "--waiting", action="store_true", help="Only dead letters not yet replayed."
        )
        replay = sub.add_parser("replay", help="Re-enqueue the original jobs.")
        replay.add_argument("ids", nargs="*", type=int, metavar="ID")
        replay.add_argument(
            "--all", action="store_true", help="Replay every dead letter not yet replayed."
        )
        purge = sub.add_parser("purge", help="Delete old dead letters.")
        purge.add_argument(
            "--older-than",
            type=int,
            required=True,
            metavar="DAYS",
            help="Delete dead letters created more than DAYS days ago.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        getattr(self, f"_{options['action']}")(options)

    def _list(self, options: dict[str, Any]) -> None:
        letters = DeadLetter.objects.order_by("-created_at", "-pk")
        if options["waiting"]:
            letters = letters.filter(replayed_at__isnull=True)
        if options["json"]:
            self.stdout.write(json.dumps([dead_letter_json(x) for x in letters], indent=2))
            return
        rows = list(letters)
        if not rows:
            self.stdout.write("No dead letters.")
            return
        self.stdout.write(
            f"{'ID':>6}  {'TASK':<30} {'ARGS':<14} {'REASON':<20} {'TRIES':>5}  "
            f"{'CREATED':<20} REPLAYED"
        )
        for x in rows:
            self.stdout.write(
                f"{x.pk:>6}  {x.task:<30} {json.dumps(x.args):<14} {x.reason:<20} "
                f"{x.attempts:>5}  {x.created_at:%Y-%m-%d %H:%M:%S}  "
                f"{x.replayed_at.strftime('%Y-%m-%d %H:%M:%S') if x.replayed_at else '-'}"
            )

    def _replay(self, options: dict[str, Any]) -> None:
        ids: list[int] = options["ids"]
        if options["all"] == bool(ids):
            raise CommandError("give dead letter IDs, or --all (not both)")
        if ids:
            unknown = sorted(
                set(ids) - set(DeadLetter.objects.filter(pk__in=ids).values_list("pk", flat=True))
            )
            if unknown:
                raise CommandError(f"no dead letter with id {', '.join(map(str, unknown))}")
        result = dead_letter_replay(ids=ids or None, actor=cli_actor())
        for pk in result.replayed:
            self.stdout.write(f"replayed dead letter {pk}")
        for pk in result.skipped:
            self.stdout.write(f"dead letter {pk} was already replayed; skipped")
        self.stdout.write(
            self.style.SUCCESS(f"{len(result.replayed)} replayed, {len(result.skipped)} skipped")
        )

    def _purge(self, options: dict[str, Any]) -> None:
        days = options["older_than"]
        if days < 0:
            raise CommandError("--older-than must be zero or more days")
        deleted = dead_letter_purge(older_than=timedelta(days=days))
        self.stdout.write(self.style.SUCCESS(f"purged {deleted} dead letter(s)"))
