"""The machinery with a domain of nothing but guests: a job enqueued in a transaction runs once
it commits and never if it rolls back; a transient failure is retried on the job's policy; a
permanent one is a dead letter with its reason in words; a replay after the cause is fixed
succeeds, and a second replay of the same letter does nothing."""

import time
from collections.abc import Callable

import pytest
from django.db import transaction
from shop.models import Guest
from shop.tasks import GREET

from asyncwork.deadletters import replay
from asyncwork.models import DeadLetter, OutboxMessage
from asyncwork.outbox import outbox_enqueue

pytestmark = pytest.mark.usefixtures("worker")


def wait_until(condition: Callable[[], bool], seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def invite(name: str, *, failures: int = 0) -> None:
    with transaction.atomic():
        Guest.objects.create(name=name, failures_left=failures)
        outbox_enqueue(task=GREET, args=[name])


def test_a_job_enqueued_in_a_transaction_runs_once_it_commits() -> None:
    invite("ada")
    assert wait_until(lambda: Guest.objects.get(name="ada").greeted == 1)
    assert OutboxMessage.objects.get().published_at is not None
    assert not DeadLetter.objects.exists()


def test_a_job_enqueued_in_a_transaction_rolled_back_never_exists() -> None:
    class Abandoned(Exception):
        pass

    def enqueue_then_fail() -> None:
        with transaction.atomic():
            outbox_enqueue(task=GREET, args=["nobody"])
            raise Abandoned

    with pytest.raises(Abandoned):
        enqueue_then_fail()
    invite("ada")  # a job after it, to know the worker had its chance
    assert wait_until(lambda: Guest.objects.get(name="ada").greeted == 1)
    assert list(OutboxMessage.objects.values_list("args", flat=True)) == [["ada"]]
    assert not DeadLetter.objects.exists()


def test_a_transient_failure_is_retried_on_the_jobs_policy() -> None:
    invite("bea", failures=2)  # the policy allows 3 attempts
    assert wait_until(lambda: Guest.objects.get(name="bea").greeted == 1)
    assert Guest.objects.get(name="bea").failures_left == 0
    assert not DeadLetter.objects.exists()


def test_failures_past_the_policy_are_a_dead_letter_with_their_reason() -> None:
    invite("cy", failures=5)
    assert wait_until(DeadLetter.objects.exists)
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.args, letter.attempts) == (GREET, ["cy"], 3)
    assert (letter.reason, letter.exception_message) == ("exhausted", "cy is not answering")
    assert Guest.objects.get(name="cy").greeted == 0


def test_a_permanent_failure_dead_letters_and_a_replay_after_the_fix_succeeds_once() -> None:
    with transaction.atomic():
        outbox_enqueue(task=GREET, args=["dan"])
    assert wait_until(DeadLetter.objects.exists)
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.exception_message, letter.attempts) == (
        "permanent",
        "no guest named dan",
        1,
    )
    Guest.objects.create(name="dan")
    with transaction.atomic():
        result = replay(ids=[letter.pk], actor="cli:test")
    assert result.replayed == [letter.pk]
    assert wait_until(lambda: Guest.objects.get(name="dan").greeted == 1)
    with transaction.atomic():
        again = replay(ids=[letter.pk], actor="cli:test")
    assert (again.replayed, again.skipped) == ([], [letter.pk])
