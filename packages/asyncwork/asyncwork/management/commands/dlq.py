"""``manage.py dlq list|replay|resolve|unresolve|purge``: the dead-letter queue from the command
line.

``list`` prints one line per dead letter within 100 columns; ``--json`` prints every stored field
plus ``subject``, ``failure``, ``age_seconds`` and ``replay_state``. Replay and resolve act on
the dead letters given by id, or on those still waiting that the filters select
(``selection``), and ``--dry-run`` shows which without acting. They are the admin's
and the API's services, called for ``BATCH`` dead letters at a time, each batch committed with
its operator actions (of ``cli:<--actor or login name>``) before the next: any number can be
replayed, which the admin and the API, bounded by a request's time, refuse beyond
``BULK_LIMIT`` with a pointer here. Every stored text printed passes through ``printable``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from asyncwork.audit import cli_actor, cli_actor_argument
from asyncwork.deadletters import (
    TIME_FORMS,
    WAITING,
    ReplayResult,
    SelectionInvalid,
    Subject,
    age,
    duration_short,
    failure,
    purge,
    refusals,
    replay,
    replay_state,
    resolve,
    selection,
    subjects,
    unresolve,
    waiting,
)
from asyncwork.logging import printable
from asyncwork.models import DeadLetter

WIDTH = 100  # the whole line, in characters

REPLAY_FORMS = """say which dead letters to replay, in one of three forms:
  manage.py dlq replay ID [ID ...]   replay these (their ids are in `manage.py dlq list`)
  manage.py dlq replay --all         replay every dead letter still waiting
  manage.py dlq replay --reason R --task T --since S --until U
                                     replay those still waiting that the filters given select
Add --dry-run to see which first. A dead letter is replayed at most once: replaying it again
does nothing."""

RESOLVE_FORMS = """say which dead letters to resolve, in one of two forms:
  manage.py dlq resolve ID [ID ...] --why TEXT
  manage.py dlq resolve --reason R --task T --since S --until U --why TEXT
                                     those still waiting that the filters given select
Add --dry-run to see which first."""

FILTERS = ("reason", "task", "since", "until")
SAMPLE = 10  # dead letters a dry run shows
# Dead letters per transaction of a replay or resolve. Each batch commits, with its operator
# actions and its jobs' outbox rows, before the next begins: a run of any size holds its row
# locks for one batch at a time, and a run cut short keeps what it committed (run it again:
# the rest still wait, and none is replayed twice).
BATCH = 500


def _batches(ids: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(ids), BATCH):
        yield ids[start : start + BATCH]


def _some(ids: Sequence[int]) -> str:
    """``3, 5, 8``, or the first ``SAMPLE`` and how many more."""
    shown = ", ".join(map(str, ids[:SAMPLE]))
    return shown if len(ids) <= SAMPLE else f"{shown} and {len(ids) - SAMPLE} more"


def _cell(value: str, width: int) -> str:
    text = printable(" ".join(value.split())) or "-"
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def dead_letter_json(letter: DeadLetter, subject: Subject | None) -> dict[str, Any]:
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
        "replay_state": replay_state(letter),
        "age_seconds": round((timezone.now() - letter.created_at).total_seconds(), 1),
        "subject": None if subject is None else dataclasses.asdict(subject),
        "failure": failure(letter),
    }


def dead_letters_table(letters: Sequence[DeadLetter], subjects: dict[int, Subject]) -> list[str]:
    """One line per dead letter within ``WIDTH`` characters, the failure taking what is left."""
    id_width = max(2, *(len(str(letter.pk)) for letter in letters))
    fixed = [
        ("ID", id_width, ">"),
        ("AGE", 5, "<"),
        ("REASON", 10, "<"),
        ("SUBJECT", 12, "<"),
        ("RECIPIENT", 16, "<"),
        ("TRIES", 5, ">"),
        ("REPLAYED", 8, "<"),
    ]
    failure_width = WIDTH - sum(width + 1 for _, width, _ in fixed)

    def line(cells: list[str]) -> str:
        *columns, failure = cells
        text = " ".join(
            f"{_cell(cell, width):{align}{width}}"
            for cell, (_, width, align) in zip(columns, fixed, strict=True)
        )
        return f"{text} {_cell(failure, failure_width)}".rstrip()

    lines = [line([name for name, _, _ in fixed] + ["FAILURE"])]
    now = timezone.now()
    for letter in letters:
        subject = subjects.get(letter.pk)
        if letter.replayed_at is not None:
            replayed = f"{duration_short((now - letter.replayed_at).total_seconds())} ago"
        else:
            replayed = "waiting" if letter.resolved_at is None else "resolved"
        lines.append(
            line(
                [
                    str(letter.pk),
                    age(letter, now=now),
                    letter.reason.partition("_")[0],  # the stored value's first word
                    subject.label if subject else f"{letter.task}{letter.args}",
                    subject.recipient if subject else "",
                    str(letter.attempts),
                    replayed,
                    failure(letter),
                ]
            )
        )
    return lines


class Command(BaseCommand):
    help = "List, replay, resolve or purge dead letters."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        listing = sub.add_parser("list", help="List dead letters, newest first.")
        listing.add_argument("--json", action="store_true", help="Print a JSON list.")
        listing.add_argument(
            "--waiting",
            action="store_true",
            help="Only dead letters neither replayed nor resolved.",
        )
        replay = sub.add_parser(
            "replay",
            help="Re-enqueue the original jobs.",
            description="Re-enqueue the original jobs of dead letters: the ones given by ID, "
            "with --all every one still waiting, or those still waiting that the filters "
            "select. A dead letter is replayed at most once, and not while its task's replay "
            "check says it would only fail again (unless --force).",
        )
        replay.add_argument("ids", nargs="*", type=int, metavar="ID")
        replay.add_argument(
            "--all", action="store_true", help="Replay every dead letter still waiting."
        )
        self._selection_arguments(replay)
        replay.add_argument(
            "--force",
            action="store_true",
            help="Replay those their replay check refuses too (it says why they would fail).",
        )
        cli_actor_argument(replay)
        resolve = sub.add_parser(
            "resolve",
            help="Mark dead letters resolved: no longer waiting, not replayed.",
            description="Mark dead letters resolved, saying why: they no longer count toward "
            "the alert, /health/ or replay --all. Reversible with unresolve. The ones given "
            "by ID, or those still waiting that the filters select.",
        )
        resolve.add_argument("ids", nargs="*", type=int, metavar="ID")
        self._selection_arguments(resolve)
        resolve.add_argument(
            "--why", help="Why the job will not be run (required, except with --dry-run)."
        )
        cli_actor_argument(resolve)
        unresolve = sub.add_parser("unresolve", help="Make resolved dead letters wait again.")
        unresolve.add_argument("ids", nargs="+", type=int, metavar="ID")
        cli_actor_argument(unresolve)
        purge = sub.add_parser("purge", help="Delete old dead letters.")
        purge.add_argument(
            "--older-than",
            type=int,
            required=True,
            metavar="DAYS",
            help="Delete dead letters created more than DAYS days ago.",
        )
        cli_actor_argument(purge)

    def _selection_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--reason",
            metavar="REASON",
            help=f"Only those of this reason: {', '.join(DeadLetter.Reason.values)}.",
        )
        parser.add_argument("--task", metavar="NAME", help="Only those of this task.")
        parser.add_argument(
            "--since", metavar="WHEN", help=f"Only those created at or after WHEN, {TIME_FORMS}."
        )
        parser.add_argument(
            "--until",
            metavar="WHEN",
            help="Only those created before WHEN (a date alone: up to the end of that day).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help=f"Print how many would be acted on, and the first {SAMPLE}; change nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        getattr(self, f"_{options['action']}")(options)

    def _list(self, options: dict[str, Any]) -> None:
        letters = waiting() if options["waiting"] else DeadLetter.objects.all()
        rows = list(letters.order_by("-created_at", "-pk"))
        described = subjects(rows)
        if options["json"]:
            listed = [dead_letter_json(x, described.get(x.pk)) for x in rows]
            self.stdout.write(json.dumps(listed, indent=2))
            return
        if not rows:
            self.stdout.write("No dead letters.")
            return
        for line in dead_letters_table(rows, described):
            self.stdout.write(line)

    def _chosen(self, options: dict[str, Any], *, every: bool) -> list[int]:
        """The ids to act on, in order: those given (checked to exist), or those still waiting
        that the filters select (with ``every``, ``--all``: every one still waiting)."""
        ids: list[int] = sorted(set(options["ids"]))
        filters = {name: options[name] for name in FILTERS if options[name] is not None}
        if ids and (filters or every):
            given = ", ".join(f"--{name}" for name in filters) or "--all"
            raise CommandError(f"give dead letter IDs or {given}, not both")
        if ids:
            self._ids_known(ids)
            return ids
        if every and filters:
            raise CommandError("--all is every dead letter still waiting: drop it to filter")
        try:
            return list(selection(**filters).values_list("pk", flat=True))
        except SelectionInvalid as exc:
            raise CommandError(printable(f"--{exc.field}: {exc.message}")) from None

    def _filtered(self, options: dict[str, Any]) -> bool:
        return any(options[name] is not None for name in FILTERS)

    def _dry_run(self, ids: list[int], *, replay: bool, force: bool = False) -> None:
        """How many ``ids`` there are, and the first ``SAMPLE`` as ``list`` prints them; for a
        ``replay``, why replaying some would only fail again (asked a batch at a time)."""
        self.stdout.write(f"{len(ids)} dead letter(s) selected; nothing done (--dry-run)")
        if ids:
            shown = list(DeadLetter.objects.filter(pk__in=ids[:SAMPLE]).order_by("pk"))
            for line in dead_letters_table(shown, subjects(shown)):
                self.stdout.write(line)
            if len(ids) > SAMPLE:
                self.stdout.write(f"... and {len(ids) - SAMPLE} more")
        if replay:
            would = "would be replayed by force, past" if force else "would be refused"
            for batch in _batches(ids):
                waiting = DeadLetter.objects.filter(WAITING, pk__in=batch).order_by("pk")
                for pk, why in sorted(refusals(waiting).items()):
                    self.stdout.write(f"dead letter {pk} {would}: {printable(why)}")

    def _replay(self, options: dict[str, Any]) -> None:
        if not (options["ids"] or options["all"] or self._filtered(options)):
            raise CommandError(REPLAY_FORMS)
        ids = self._chosen(options, every=options["all"])
        if options["dry_run"]:
            self._dry_run(ids, replay=True, force=options["force"])
            return
        actor = cli_actor(options["actor"])
        replayed, skipped, refused = 0, 0, []
        for batch in _batches(ids):
            result = replay(ids=batch, actor=actor, force=options["force"])
            self._replay_reported(result)
            replayed += len(result.replayed)
            skipped += len(result.skipped) + len(result.resolved)
            refused += list(result.refused)
        summary = f"{replayed} replayed, {skipped} skipped"
        if not refused:
            self.stdout.write(self.style.SUCCESS(summary))
            return
        raise CommandError(
            f"{summary}, {len(refused)} refused (dead letter {_some(refused)}): their replay "
            "check says they would only fail again. Fix what it names, or replay them anyway "
            "with --force."
        )

    def _replay_reported(self, result: ReplayResult) -> None:
        """One line per dead letter of a committed batch."""
        for pk in result.replayed:
            if pk in result.forced:
                forced = printable(result.forced[pk])
                self.stdout.write(f"replayed dead letter {pk}, forced past: {forced}")
            else:
                self.stdout.write(f"replayed dead letter {pk}")
        for pk in result.skipped:
            self.stdout.write(f"dead letter {pk} was already replayed; skipped")
        for pk in result.resolved:
            self.stdout.write(f"dead letter {pk} is resolved; unresolve it to replay it")
        for pk, why in result.refused.items():
            self.stdout.write(f"dead letter {pk} not replayed: {printable(why)}")

    def _ids_known(self, ids: list[int]) -> None:
        known = set(DeadLetter.objects.filter(pk__in=ids).values_list("pk", flat=True))
        unknown = sorted(set(ids) - known)
        if unknown:
            raise CommandError(f"no dead letter with id {', '.join(map(str, unknown))}")

    def _resolve(self, options: dict[str, Any]) -> None:
        if not (options["ids"] or self._filtered(options)):
            raise CommandError(RESOLVE_FORMS)
        ids = self._chosen(options, every=False)
        if options["dry_run"]:
            self._dry_run(ids, replay=False)
            return
        if not (options["why"] or "").strip():
            raise CommandError("say why with --why: the operators after you will read it")
        actor = cli_actor(options["actor"])
        resolved, skipped = 0, 0
        for batch in _batches(ids):
            result = resolve(ids=batch, actor=actor, why=options["why"])
            for pk in result.changed:
                self.stdout.write(f"resolved dead letter {pk}")
            for pk in result.skipped:
                self.stdout.write(f"dead letter {pk} was replayed or resolved before; skipped")
            resolved += len(result.changed)
            skipped += len(result.skipped)
        self.stdout.write(self.style.SUCCESS(f"{resolved} resolved, {skipped} skipped"))

    def _unresolve(self, options: dict[str, Any]) -> None:
        self._ids_known(options["ids"])
        result = unresolve(ids=options["ids"], actor=cli_actor(options["actor"]))
        for pk in result.changed:
            self.stdout.write(f"dead letter {pk} waits again")
        for pk in result.skipped:
            self.stdout.write(f"dead letter {pk} was not resolved; skipped")
        self.stdout.write(
            self.style.SUCCESS(f"{len(result.changed)} unresolved, {len(result.skipped)} skipped")
        )

    def _purge(self, options: dict[str, Any]) -> None:
        days = options["older_than"]
        if days < 0:
            raise CommandError("--older-than must be zero or more days")
        deleted = purge(older_than=timedelta(days=days), actor=cli_actor(options["actor"]))
        self.stdout.write(self.style.SUCCESS(f"purged {deleted} dead letter(s)"))
