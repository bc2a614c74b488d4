"""Resolving a dead letter: an operator's decision that its job will not be run, with who, when
and why. A resolved letter no longer waits (the alert, health and ``replay --all`` leave it
out), is never replayed while resolved, and is waiting again once unresolved; each step is
announced as an operator action, and the command line says what it did."""

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from shop.tasks import greet

from asyncwork.audit import operator_acted
from asyncwork.contrib.monitoring.probes import dlq_probe
from asyncwork.contrib.periodic.alert import dlq_alert
from asyncwork.deadletters import (
    replay,
    replay_state,
    resolve,
    unresolve,
    waiting,
)
from asyncwork.models import DeadLetter, Job

pytestmark = pytest.mark.django_db


def letter(name: str) -> DeadLetter:
    now = timezone.now()
    return DeadLetter.objects.create(
        task=greet.module_path,
        task_id=f"task-{name}",
        args=[name],
        queue="default",
        reason=DeadLetter.Reason.PERMANENT,
        exception_message=f"no guest named {name}",
        attempts=1,
        first_failed_at=now,
        last_failed_at=now,
    )


@pytest.fixture
def announced() -> Any:
    actions: list[tuple[str, str, str]] = []

    def keep(*, action: str, actor: str, detail: str, **_: Any) -> None:
        actions.append((action, actor, detail))

    operator_acted.connect(keep, dispatch_uid="test.keep")
    yield actions
    operator_acted.disconnect(dispatch_uid="test.keep")


def manage(*args: str) -> str:
    out = StringIO()
    call_command("dlq", *args, stdout=out)
    return out.getvalue()


def test_a_resolved_letter_no_longer_waits_and_replay_all_leaves_it(announced: Any) -> None:
    kept, dropped = letter("ada"), letter("bob")
    assert dlq_probe().waiting == 2

    result = resolve(ids=[dropped.pk], actor="cli:op", why="bob left the party")
    assert (result.changed, result.skipped) == ([dropped.pk], [])
    assert list(waiting()) == [kept]
    assert dlq_probe().waiting == 1  # what /health/ and the metrics read
    assert dlq_alert() == 1  # the depth the alert compares with its threshold
    dropped.refresh_from_db()
    assert (dropped.resolved_by, dropped.resolved_why) == ("cli:op", "bob left the party")
    assert replay_state(dropped).startswith("resolved by cli:op at ")
    assert replay_state(dropped).endswith(": bob left the party")

    replayed = replay(actor="cli:op")  # --all
    assert replayed.replayed == [kept.pk]
    assert announced == [
        ("dead_letter.resolve", "cli:op", "resolved: bob left the party"),
        ("dead_letter.replay", "cli:op", replayed_detail(kept)),
    ]


def replayed_detail(letter: DeadLetter) -> str:
    letter.refresh_from_db()
    return f"replayed: the job is job {letter.replay_job_id}"


def test_a_resolved_letter_is_not_replayed_even_by_id_until_unresolved() -> None:
    dropped = letter("bob")
    resolve(ids=[dropped.pk], actor="admin:op", why="refunded")
    refused = replay(ids=[dropped.pk], actor="admin:op")
    assert (refused.replayed, refused.resolved) == ([], [dropped.pk])
    assert not Job.objects.exists()

    undone = unresolve(ids=[dropped.pk], actor="admin:op")
    assert undone.changed == [dropped.pk]
    assert list(waiting()) == [dropped]
    assert replay(ids=[dropped.pk], actor="admin:op").replayed == [dropped.pk]
    # Replayed, it cannot be resolved any more.
    assert resolve(ids=[dropped.pk], actor="admin:op", why="late").skipped == [dropped.pk]


def test_resolving_needs_a_reason_and_a_failing_record_undoes_it() -> None:
    dropped = letter("bob")
    with pytest.raises(ValueError, match="say why"):
        resolve(ids=[dropped.pk], actor="cli:op", why="  ")

    def refuse(**_: Any) -> None:
        raise RuntimeError("the audit trail is down")

    operator_acted.connect(refuse, dispatch_uid="test.refuse")
    try:
        with pytest.raises(RuntimeError):
            resolve(ids=[dropped.pk], actor="cli:op", why="refunded")
    finally:
        operator_acted.disconnect(dispatch_uid="test.refuse")
    dropped.refresh_from_db()
    assert dropped.resolved_at is None


def test_the_command_line_resolves_unresolves_and_says_what_it_did() -> None:
    dropped, other = letter("bob"), letter("cy")
    out = manage("resolve", str(dropped.pk), "--why", "refunded", "--actor", "ops")
    assert out.splitlines() == [f"resolved dead letter {dropped.pk}", "1 resolved, 0 skipped"]
    assert DeadLetter.objects.get(pk=dropped.pk).resolved_by == "cli:ops"
    listed = manage("list", "--waiting")
    assert "no guest named cy" in listed
    assert "no guest named bob" not in listed
    (row,) = [line for line in manage("list").splitlines() if "no guest named bob" in line]
    assert " resolved " in row
    out = manage("replay", "--all", "--actor", "ops")
    assert out.splitlines() == [f"replayed dead letter {other.pk}", "1 replayed, 0 skipped"]
    out = manage("replay", str(dropped.pk), "--actor", "ops")
    assert out.splitlines() == [
        f"dead letter {dropped.pk} is resolved; unresolve it to replay it",
        "0 replayed, 1 skipped",
    ]
    out = manage("unresolve", str(dropped.pk), "--actor", "ops")
    assert out.splitlines() == [f"dead letter {dropped.pk} waits again", "1 unresolved, 0 skipped"]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["resolve", "999", "--why", "x"], "no dead letter with id 999"),
        (["resolve", "{pk}", "--why", " "], "say why with --why"),
        (["unresolve", "999"], "no dead letter with id 999"),
    ],
)
def test_the_command_line_refuses_with_a_clear_error(args: list[str], error: str) -> None:
    dropped = letter("bob")
    with pytest.raises(CommandError, match=error):
        manage(*[a.format(pk=dropped.pk) for a in args])
    assert DeadLetter.objects.get(pk=dropped.pk).resolved_at is None


def test_resolving_twice_keeps_the_first_decision() -> None:
    dropped = letter("bob")
    first = resolve(ids=[dropped.pk], actor="admin:a", why="refunded")
    second = resolve(ids=[dropped.pk], actor="admin:b", why="paid by hand")
    assert (first.changed, second.skipped) == ([dropped.pk], [dropped.pk])
    assert DeadLetter.objects.get(pk=dropped.pk).resolved_by == "admin:a"
