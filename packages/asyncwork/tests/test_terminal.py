"""``printable``: text a command prints that was stored or sent to it, escaped wherever a
terminal would obey it (every C0 and C1 control, DEL, line breaks, invisible format
characters) and left as it is otherwise; and ``dlq`` printing a replay check's words, which
quote what the job's app stored, through it."""

from collections.abc import Iterator, Sequence
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from shop.tasks import greet

from asyncwork import deadletters
from asyncwork.logging import printable
from asyncwork.models import DeadLetter

# Sets the terminal's title and clears its screen; then C1's one-byte CSI and a forged line.
HOSTILE = "x\x1b]0;pwned\x07\x1b[2J\x9b2J\r\nforged"


def controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F}


def test_every_control_is_escaped_and_the_rest_kept() -> None:
    for code in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, 0x200B, 0x202E]:
        text = f"a{chr(code)}b"
        assert printable(text) == repr(text)
        assert printable(text).isprintable(), hex(code)
    for kept in ("Ada Lovelace <ada@example.com>", "Zoë, 日本, café", "a 'quote' and \\"):
        assert printable(kept) == kept
    assert printable(HOSTILE) == "'x\\x1b]0;pwned\\x07\\x1b[2J\\x9b2J\\r\\nforged'"


@pytest.fixture
def hostile_check() -> Iterator[None]:
    @deadletters.replay_check(greet)
    def says_what_was_stored(letters: Sequence[DeadLetter]) -> dict[int, str]:
        return {letter.pk: f"no guest named {letter.args[0]}" for letter in letters}

    yield
    deadletters._replay_checks.pop(greet.module_path)


@pytest.mark.django_db
def test_dlq_prints_a_replay_checks_words_escaped(hostile_check: None) -> None:
    now = timezone.now()
    letter = DeadLetter.objects.create(
        task=greet.module_path,
        task_id="t-hostile",
        args=[HOSTILE],
        queue="default",
        reason="permanent",
        exception_message=f"no guest named {HOSTILE}",
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
    )
    listed, dry_run, replay = StringIO(), StringIO(), StringIO()

    call_command("dlq", "list", stdout=listed)
    call_command("dlq", "replay", str(letter.pk), "--dry-run", stdout=dry_run)
    with pytest.raises(CommandError):
        call_command("dlq", "replay", str(letter.pk), "--actor", "op", stdout=replay)

    escaped = "no guest named x\\x1b]0;pwned\\x07\\x1b[2J\\x9b2J\\r\\nforged"
    assert f"dead letter {letter.pk} would be refused: '{escaped}'" in dry_run.getvalue()
    assert f"dead letter {letter.pk} not replayed: '{escaped}'" in replay.getvalue()
    for out in (listed, dry_run, replay):
        assert not controls(out.getvalue())
