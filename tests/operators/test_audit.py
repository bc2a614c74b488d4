"""The operator audit trail: written in the transaction of the action it records (so an action
rolled back leaves no row), never without an actor, and the command line's actor is the OS
user."""

from __future__ import annotations

import getpass

import pytest
from django.db import transaction
from django.utils import timezone

from asyncwork.deadletters import dead_letter_replay
from asyncwork.models import DeadLetter
from operators.audit import cli_actor, operator_action_record
from operators.models import OperatorAction

pytestmark = pytest.mark.django_db(transaction=True)


def letter() -> DeadLetter:
    return DeadLetter.objects.create(
        task="core.does_not_exist",
        task_id="t1",
        args=[1],
        queue="email",
        reason="permanent",
        attempts=1,
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )


def test_an_action_rolled_back_leaves_no_record() -> None:
    waiting = letter()

    inside: list[int] = []

    class Abort(Exception):
        pass

    def replay_then_fail() -> None:
        with transaction.atomic():
            dead_letter_replay(ids=[waiting.pk], actor="admin:op")
            inside.append(OperatorAction.objects.count())
            raise Abort

    with pytest.raises(Abort):
        replay_then_fail()

    assert inside == [1]  # inside the transaction, the record was there
    assert not OperatorAction.objects.exists()
    waiting.refresh_from_db()
    assert waiting.replayed_at is None


def test_a_record_outside_a_transaction_or_without_an_actor_is_refused() -> None:
    waiting = letter()
    with pytest.raises(RuntimeError, match="inside the transaction"):
        operator_action_record(action="x", actor="admin:op", target=waiting)
    with pytest.raises(ValueError, match="needs an actor"), transaction.atomic():
        operator_action_record(action="x", actor="", target=waiting)
    assert not OperatorAction.objects.exists()


def test_the_command_lines_actor_is_the_os_user() -> None:
    assert cli_actor() == f"cli:{getpass.getuser()}"
