"""Dead letters chosen in bulk and replays checked first: ``selection`` narrows those
still waiting by reason, task and creation time; ``dlq replay`` and ``dlq resolve`` act on that
selection or show it with ``--dry-run``; a task's replay check (declared here, for the shop's
greeting: a guest still missing) keeps a replay that would only fail again from running unless
forced; and what became of a replayed job is read back from its job and the dead letters."""

import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone
from shop.models import Guest
from shop.tasks import fail_with_a_bug, greet

from asyncwork import deadletters
from asyncwork.audit import operator_acted
from asyncwork.backend import message_id
from asyncwork.deadletters import (
    OUTCOME_DEAD_LETTERED,
    OUTCOME_PUBLISHED,
    OUTCOME_RETRYING,
    OUTCOME_RUNNING,
    OUTCOME_SUCCEEDED,
    OUTCOME_UNPUBLISHED,
    SelectionInvalid,
    refusals,
    replay,
    replay_check,
    replay_outcomes,
    selection,
)
from asyncwork.models import DeadLetter, Job

GREET = greet.module_path
# Another task of the shop's: its dead letters are not the greeting's.
OTHER = fail_with_a_bug.module_path


def letter(
    name: str, *, task: str = GREET, reason: str = "permanent", created: datetime | None = None
) -> DeadLetter:
    now = timezone.now()
    row = DeadLetter.objects.create(
        task=task,
        task_id=f"task-{name}",
        args=[name],
        queue="default",
        reason=reason,
        exception_message=f"no guest named {name}",
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
    )
    if created is not None:  # created_at is set on insert
        DeadLetter.objects.filter(pk=row.pk).update(created_at=created)
        row.refresh_from_db()
    return row


@pytest.fixture
def guests_checked() -> Iterator[None]:
    """The greeting's replay check: a guest that is still missing would fail the same way."""

    @replay_check(greet)
    def guests_missing(letters: Sequence[DeadLetter]) -> dict[int, str]:
        names = {letter.args[0] for letter in letters}
        here = set(Guest.objects.filter(name__in=names).values_list("name", flat=True))
        return {
            letter.pk: f"no guest named {letter.args[0]} yet: invite the guest first"
            for letter in letters
            if letter.args[0] not in here
        }

    yield
    deadletters._replay_checks.pop(GREET)


@pytest.fixture
def announced() -> Iterator[list[tuple[str, str, str]]]:
    actions: list[tuple[str, str, str]] = []

    def keep(*, action: str, actor: str, detail: str, **_: Any) -> None:
        actions.append((action, actor, detail))

    operator_acted.connect(keep, dispatch_uid="test.bulk.keep")
    yield actions
    operator_acted.disconnect(dispatch_uid="test.bulk.keep")


def wait_until(condition: Callable[[], bool], seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def dlq(*args: str) -> str:
    out = StringIO()
    call_command("dlq", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
class TestSelect:
    @timezone.override(UTC)
    def test_each_filter_narrows_the_waiting_letters(self) -> None:
        day = datetime(2026, 12, 1, tzinfo=UTC)
        early = letter("ada", created=day + timedelta(hours=1))
        late = letter("bob", reason="exhausted", created=day + timedelta(days=1, hours=23))
        other = letter("cy", task=OTHER, created=day + timedelta(days=2, hours=1))
        done = letter("dan", created=day + timedelta(hours=2))
        DeadLetter.objects.filter(pk=done.pk).update(resolved_at=timezone.now())

        def chosen(**filters: Any) -> list[int]:
            return list(selection(**filters).values_list("pk", flat=True))

        assert chosen() == [early.pk, late.pk, other.pk]  # not the resolved one
        assert chosen(reason="exhausted") == [late.pk]
        assert chosen(task=OTHER) == [other.pk]
        assert chosen(task=GREET, reason="permanent") == [early.pk]
        # A date alone is its day: since its start, until its end.
        assert chosen(since="2026-12-02") == [late.pk, other.pk]
        assert chosen(until="2026-12-02") == [early.pk, late.pk]
        assert chosen(since="2026-12-02", until="2026-12-02") == [late.pk]
        # A date and time is that moment: since inclusive, until exclusive; an offset is kept.
        assert chosen(since="2026-12-01T01:00:00Z") == [early.pk, late.pk, other.pk]
        assert chosen(until="2026-12-01T01:00:00Z") == []
        assert chosen(until="2026-12-02T00:00+01:00") == [early.pk]
        assert chosen(since=day + timedelta(days=2)) == [other.pk]
        # Without an offset, in the current time zone.
        with timezone.override("Asia/Tokyo"):
            assert chosen(until="2026-12-01T10:00") == []
            assert chosen(until="2026-12-01T10:01") == [early.pk]
            # Tokyo's 1 December is from 15:00 UTC the day before to 15:00 UTC.
            assert chosen(since="2026-12-01", until="2026-12-01") == [early.pk]
            assert chosen(since="2026-12-03", until="2026-12-03") == [late.pk, other.pk]

    @pytest.mark.parametrize(
        ("filters", "field", "words"),
        [
            ({"reason": "lost"}, "reason", "'lost' is not one of permanent, exhausted, "),
            ({"task": " "}, "task", "give a task name"),
            ({"since": "yesterday"}, "since", "'yesterday' is not an ISO date or date and time"),
            ({"until": "2026-02-30"}, "until", "'2026-02-30' is not an ISO date"),
            ({"until": "2026-12-03T25:00"}, "until", "is not an ISO date"),
            ({"since": "2026-12-03", "until": "2026-12-02"}, "until", "later than since"),
            ({"until": "9999-12-31"}, "until", "'9999-12-31' is out of range: its end is past"),
        ],
    )
    def test_a_filter_it_cannot_read_is_named(
        self, filters: dict[str, str], field: str, words: str
    ) -> None:
        with pytest.raises(SelectionInvalid) as refused:
            selection(**filters)
        assert refused.value.field == field
        assert words in refused.value.message


@pytest.mark.django_db
class TestReplayCheck:
    def test_a_refused_letter_is_not_replayed_and_the_others_are(
        self, guests_checked: None, announced: list[tuple[str, str, str]]
    ) -> None:
        Guest.objects.create(name="ada")
        here, missing = letter("ada"), letter("bob")

        result = replay(ids=[here.pk, missing.pk], actor="cli:op")

        why = "no guest named bob yet: invite the guest first"
        assert (result.replayed, result.refused, result.forced) == (
            [here.pk],
            {missing.pk: why},
            {},
        )
        missing.refresh_from_db()
        assert (missing.replayed_at, missing.replay_job) == (None, None)
        assert Job.objects.get().args == ["ada"]
        assert announced[1] == ("dead_letter.replay", "cli:op", f"refused: {why}")

    def test_force_replays_it_and_records_what_it_overrode(
        self, guests_checked: None, announced: list[tuple[str, str, str]]
    ) -> None:
        missing = letter("bob")

        result = replay(ids=[missing.pk], actor="cli:op", force=True)

        why = "no guest named bob yet: invite the guest first"
        assert (result.replayed, result.refused, result.forced) == (
            [missing.pk],
            {},
            {missing.pk: why},
        )
        missing.refresh_from_db()
        assert announced == [
            (
                "dead_letter.replay",
                "cli:op",
                f"replayed: the job is job {missing.replay_job_id}; "
                f"forced past its check, which said: {why}",
            )
        ]

    def test_a_check_that_fails_refuses_saying_so(self, caplog: pytest.LogCaptureFixture) -> None:
        def broken(letters: Sequence[DeadLetter]) -> dict[int, str]:
            raise RuntimeError("the guest list is unreadable")

        deadletters._replay_checks[OTHER] = broken
        try:
            unchecked, free = letter("ada", task=OTHER), letter("bob")
            assert refusals([unchecked, free]) == {
                unchecked.pk: "its replay check failed (RuntimeError: the guest list is "
                "unreadable), so it is unchecked"
            }
            assert replay(ids=[unchecked.pk, free.pk], actor="cli:op").replayed == [free.pk]
        finally:
            deadletters._replay_checks.pop(OTHER)
        assert f"the replay check of {OTHER} failed" in caplog.text


@pytest.mark.django_db
class TestCommand:
    def test_a_dry_run_prints_the_count_and_a_sample_and_changes_nothing(
        self, guests_checked: None, announced: list[tuple[str, str, str]]
    ) -> None:
        Guest.objects.create(name="guest-0")
        hours_ago = timezone.now() - timedelta(hours=3)  # an age that will not tick over
        letters = [letter(f"guest-{n}", created=hours_ago) for n in range(12)]
        letter("other", task=OTHER)

        out = dlq("replay", "--task", GREET, "--dry-run").splitlines()

        assert out[0] == "12 dead letter(s) selected; nothing done (--dry-run)"
        assert out[1].split() == [
            "ID", "AGE", "REASON", "SUBJECT", "RECIPIENT", "TRIES", "REPLAYED", "FAILURE"
        ]  # fmt: skip
        # The same lines as dlq list, for the first ten (the ids' column as wide as its longest).
        listed = {line.split()[0]: line.strip() for line in dlq("list").splitlines()[1:]}
        assert [line.strip() for line in out[2:12]] == [listed[str(x.pk)] for x in letters[:10]]
        assert out[12] == "... and 2 more"
        assert out[13:] == [
            f"dead letter {x.pk} would be refused: no guest named guest-{n} yet: invite the "
            "guest first"
            for n, x in enumerate(letters)
            if n
        ]
        assert announced == []
        assert not Job.objects.exists()
        assert dlq("resolve", "--task", OTHER, "--dry-run").splitlines()[0] == (
            "1 dead letter(s) selected; nothing done (--dry-run)"
        )
        assert DeadLetter.objects.filter(resolved_at__isnull=False).count() == 0

    def test_the_filters_choose_what_replay_and_resolve_act_on(self) -> None:
        old = letter("ada", created=timezone.now() - timedelta(days=3))
        new, other = letter("bob"), letter("cy", task=OTHER, reason="exhausted")
        since = (timezone.now() - timedelta(days=1)).date().isoformat()

        out = dlq("resolve", "--reason", "exhausted", "--why", "cy moved away", "--actor", "op")
        assert out.splitlines() == [f"resolved dead letter {other.pk}", "1 resolved, 0 skipped"]
        out = dlq("replay", "--since", since, "--actor", "op")
        assert out.splitlines() == [f"replayed dead letter {new.pk}", "1 replayed, 0 skipped"]
        old.refresh_from_db()
        assert (old.replayed_at, old.resolved_at) == (None, None)
        assert dlq("replay", "--since", since, "--dry-run").startswith("0 dead letter(s) selected")

    def test_refused_letters_are_named_and_the_exit_is_an_error_after_the_others(
        self, guests_checked: None
    ) -> None:
        Guest.objects.create(name="ada")
        here, missing = letter("ada"), letter("bob")
        out = StringIO()

        with pytest.raises(CommandError) as refused:
            call_command("dlq", "replay", "--all", "--actor", "op", stdout=out)

        assert out.getvalue().splitlines() == [
            f"replayed dead letter {here.pk}",
            f"dead letter {missing.pk} not replayed: no guest named bob yet: invite the guest "
            "first",
        ]
        assert str(refused.value) == (
            f"1 replayed, 0 skipped, 1 refused (dead letter {missing.pk}): their replay check "
            "says they would only fail again. Fix what it names, or replay them anyway with "
            "--force."
        )
        assert list(selection()) == [missing]
        forced = dlq("replay", str(missing.pk), "--force", "--actor", "op").splitlines()
        assert forced == [
            f"replayed dead letter {missing.pk}, forced past: no guest named bob yet: invite "
            "the guest first",
            "1 replayed, 0 skipped",
        ]

    @pytest.mark.parametrize(
        ("args", "error"),
        [
            (["replay", "{pk}", "--reason", "permanent"], "give dead letter IDs or --reason, not"),
            (["replay", "--all", "--task", GREET], "--all is every dead letter still waiting"),
            (["replay", "{pk}", "--all"], "give dead letter IDs or --all, not both"),
            (["replay", "--reason", "lost"], "--reason: 'lost' is not one of permanent, "),
            (["replay", "--since", "soon"], "--since: 'soon' is not an ISO date or date and"),
            (["resolve", "--until", "2026-13-01", "--why", "x"], "--until: '2026-13-01' is not"),
            (["replay", "--until", "9999-12-31"], "--until: '9999-12-31' is out of range"),
            (["resolve", "--task", GREET], "say why with --why"),
            (["resolve", "--dry-run"], "say which dead letters to resolve"),
            (["replay", "--dry-run"], "say which dead letters to replay"),
        ],
    )
    def test_bad_input_is_a_clear_error_and_nothing_is_done(
        self, args: list[str], error: str
    ) -> None:
        waiting = letter("ada")
        with pytest.raises(CommandError, match=error):
            dlq(*[arg.format(pk=waiting.pk) for arg in args])
        waiting.refresh_from_db()
        assert (waiting.replayed_at, waiting.resolved_at) == (None, None)


@pytest.mark.django_db
def test_what_became_of_a_replay_each_state_of_its_job() -> None:
    waiting, pending, sent, running, retried, succeeded, failed = (letter(n) for n in "tuvwxyz")
    now = timezone.now()
    due = now + timedelta(minutes=5)
    error = {"exception_class_path": "asyncwork.errors.TransientError", "traceback": ""}
    # Each replay's job as the machinery leaves it (no broker here: nothing runs).
    states: list[tuple[DeadLetter, dict[str, Any]]] = [
        (pending, {}),
        (sent, {"published_at": now}),
        (running, {"published_at": now, "status": Job.Status.RUNNING, "attempts": 1}),
        # Failed once, READY again and unpublished until its backoff is over.
        (retried, {"attempts": 1, "errors": [error], "due_at": due}),
        (succeeded, {"published_at": now, "status": Job.Status.SUCCESSFUL, "finished_at": now}),
        (failed, {"published_at": now, "status": Job.Status.FAILED, "attempts": 1}),
    ]
    for row, fields in states:
        row.replay_job = Job.objects.create(task=GREET, args=row.args, queue="default", **fields)
        row.replayed_at = now
        row.save()
    # The failed replay dead-lettered again, under its job's task id.
    again = DeadLetter.objects.create(
        task=GREET,
        task_id=message_id(failed.replay_job_id or 0),
        args=["z"],
        queue="default",
        reason="permanent",
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
    )

    rows = list(DeadLetter.objects.select_related("replay_job").filter(pk__lte=failed.pk))
    outcomes = replay_outcomes(rows)

    assert waiting.pk not in outcomes
    assert {pk: outcome.state for pk, outcome in outcomes.items()} == {
        pending.pk: OUTCOME_UNPUBLISHED,
        sent.pk: OUTCOME_PUBLISHED,
        running.pk: OUTCOME_RUNNING,
        retried.pk: OUTCOME_RETRYING,
        succeeded.pk: OUTCOME_SUCCEEDED,
        failed.pk: OUTCOME_DEAD_LETTERED,
    }
    assert outcomes[pending.pk].text == f"job {pending.replay_job_id} not yet published"
    assert outcomes[sent.pk].text.startswith(f"job {sent.replay_job_id} published ")
    assert outcomes[sent.pk].text.endswith(": waiting")
    assert outcomes[running.pk].text == f"job {running.replay_job_id} is running"
    assert outcomes[retried.pk].text.startswith(
        f"job {retried.replay_job_id} failed again; a retry is due "
    )
    assert outcomes[succeeded.pk].text.startswith(f"job {succeeded.replay_job_id} succeeded ")
    assert outcomes[failed.pk].again == again
    assert outcomes[failed.pk].text == f"dead-lettered again as dead letter #{again.pk}"


@pytest.mark.usefixtures("worker")
def test_through_the_pipeline_refused_then_forced_dead_letters_again_then_fixed_succeeds(
    guests_checked: None,
) -> None:
    """A real worker: the replay check holds back a replay while the guest is missing; forced,
    the job fails the same way and is a dead letter again, found from the replay; once the
    guest is invited, that one replays, the guest is greeted and the replay reads succeeded."""
    with transaction.atomic():
        greet.enqueue("eve")
    assert wait_until(DeadLetter.objects.exists)
    first = DeadLetter.objects.get()

    assert replay(ids=[first.pk], actor="cli:op").refused
    forced = replay(ids=[first.pk], actor="cli:op", force=True)
    assert forced.replayed == [first.pk]
    assert wait_until(lambda: DeadLetter.objects.count() == 2)
    first = DeadLetter.objects.select_related("replay_job").get(pk=first.pk)
    outcome = replay_outcomes([first])[first.pk]
    second = DeadLetter.objects.exclude(pk=first.pk).get()
    assert (outcome.state, outcome.again) == (OUTCOME_DEAD_LETTERED, second)

    Guest.objects.create(name="eve")
    assert replay(ids=[second.pk], actor="cli:op").replayed == [second.pk]

    def outcome_of_second() -> str:
        row = DeadLetter.objects.select_related("replay_job").get(pk=second.pk)
        return replay_outcomes([row])[second.pk].state

    assert wait_until(lambda: outcome_of_second() == OUTCOME_SUCCEEDED)
    assert Guest.objects.get(name="eve").greeted == 1
    assert DeadLetter.objects.count() == 2
