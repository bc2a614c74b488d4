"""The operator audit trail: written in the transaction of the action it records (so an action
rolled back leaves no row), never without an actor, and the command line's actor is the one
``--actor`` names, else the OS login name, whichever command acts."""

from __future__ import annotations

import getpass
import itertools
import shutil
import subprocess
import sys
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.utils import timezone

from asyncwork.audit import cli_actor, operator_acted, operator_action_record
from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.operators.tokens import api_token_create
from asyncwork.deadletters import replay
from asyncwork.models import DeadLetter
from stack.process import ROOT
from tests.helpers.deadletters import dead_letter as letter
from tests.helpers.factories import staff_user
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_action_rolled_back_leaves_no_record() -> None:
    waiting = letter()

    inside: list[int] = []

    class Abort(Exception):
        pass

    def replay_then_fail() -> None:
        with transaction.atomic():
            replay(ids=[waiting.pk], actor="admin:op")
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


def test_a_receiver_that_fails_undoes_the_action() -> None:
    """The machinery announces an action inside its transaction: a receiver that cannot keep the
    record (here, one that raises) leaves the dead letter waiting, as if nothing was done."""
    waiting = letter()

    class Unkept(Exception):
        pass

    def refuse(**_: object) -> None:
        raise Unkept

    operator_acted.connect(refuse, dispatch_uid="test.refuse")
    try:
        with pytest.raises(Unkept):
            replay(ids=[waiting.pk], actor="admin:op")
    finally:
        operator_acted.disconnect(dispatch_uid="test.refuse")
    waiting.refresh_from_db()
    assert waiting.replayed_at is None
    assert not OperatorAction.objects.exists()


def test_the_command_lines_actor_is_the_os_user() -> None:
    assert cli_actor() == f"cli:{getpass.getuser()}"


_old = itertools.count(1)


def old_letter() -> DeadLetter:
    """A dead letter ``dlq purge --older-than 30`` deletes."""
    made = letter(f"old-{next(_old)}")
    DeadLetter.objects.filter(pk=made.pk).update(created_at=timezone.now() - timedelta(days=40))
    return made


def acting_command(command: str) -> list[str]:
    """The arguments of ``command``, one that acts (and so records an operator action), with
    what it acts on made first."""
    if command == "dlq replay":
        return ["dlq", "replay", str(letter().pk)]
    if command == "dlq purge":
        old_letter()
        return ["dlq", "purge", "--older-than", "30"]
    staff_user("ops")
    if command == "api_token revoke":
        api_token_create(username="ops", actor="cli:setup")
        OperatorAction.objects.all().delete()
    return [*command.split(), "ops"]


@pytest.mark.parametrize(
    "command", ["dlq replay", "dlq purge", "api_token create", "api_token revoke"]
)
def test_every_acting_command_records_the_actor_it_is_given(command: str) -> None:
    args = acting_command(command)
    call_command(*args, "--actor", "Jane Doe", stdout=StringIO(), stderr=StringIO())
    assert list(OperatorAction.objects.values_list("actor", flat=True)) == ["cli:Jane Doe"]


def manage(
    *args: str, prefix: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """A real ``python manage.py <args>`` on this test's database (after ``prefix``, a command
    that runs it), with ``env`` in place of the login-name variables getpass reads."""
    names = ("LOGNAME", "USER", "LNAME", "USERNAME")
    bare = {k: v for k, v in worker_env(0).items() if k not in names}
    return subprocess.run(
        [*prefix, sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**bare, **env},
    )


def test_without_actor_a_command_records_the_login_name() -> None:
    first, second = old_letter(), old_letter()
    purged = manage("dlq", "purge", "--older-than", "30", LOGNAME="carol", USER="carol")
    assert purged.returncode == 0, purged.stderr
    assert "purged 2 dead letter(s)" in purged.stdout
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.actor, a.target_id) for a in recorded] == [
        ("cli:carol", str(first.pk)),
        ("cli:carol", str(second.pk)),
    ]


NO_ACCOUNT = 12345  # a uid with no passwd entry


def _as_no_account() -> tuple[str, ...] | None:
    """``unshare`` into a user namespace where this process is uid ``NO_ACCOUNT`` (its files
    stay its own outside), or None where user namespaces cannot be made."""
    if shutil.which("unshare") is None:
        return None
    prefix = ("unshare", "--user", f"--map-user={NO_ACCOUNT}", f"--map-group={NO_ACCOUNT}")
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False, timeout=10)
    return prefix if probe.returncode == 0 else None


@pytest.mark.slow
def test_a_uid_with_no_account_and_no_login_variables_is_named_by_its_uid() -> None:
    """As in a container started with ``--user 12345``: no passwd entry, no $USER, no tty."""
    prefix = _as_no_account()
    if prefix is None:
        pytest.skip("user namespaces cannot be made here (unshare --user)")
    old_letter()
    purged = manage("dlq", "purge", "--older-than", "30", prefix=prefix)
    assert purged.returncode == 0, purged.stderr
    assert list(OperatorAction.objects.values_list("actor", flat=True)) == [f"cli:uid {NO_ACCOUNT}"]


@pytest.mark.parametrize("bad", ["", "   ", "x" * 101, "bad\x1bname"])
@pytest.mark.slow
def test_a_bad_actor_is_a_clear_error_and_nothing_is_done(bad: str) -> None:
    waiting = old_letter()
    with pytest.raises(CommandError, match="give who is acting"):
        call_command("dlq", "purge", "--older-than", "30", "--actor", bad, stdout=StringIO())
    refused = manage("dlq", "purge", "--older-than", "30", "--actor", bad)
    assert refused.returncode == 2  # argparse's status for a bad argument
    assert "argument --actor: give who is acting: 1 to 100 printable characters" in (refused.stderr)
    assert "Traceback" not in refused.stderr
    assert DeadLetter.objects.filter(pk=waiting.pk).exists()
    assert not OperatorAction.objects.exists()
