"""Django's task API on asyncwork's backend, with a domain of nothing but guests, a real worker
(Celery's own test worker in this process, or ``celery worker`` processes), PostgreSQL and Redis:
an enqueue commits or rolls back with the caller's data; a task runs once its transaction
commits; a transient failure is retried on the task's policy and a bug fails at once, each
failure recorded; a failed task is a dead letter whose replay runs it again, once; ``run_after``
waits in PostgreSQL; a task the worker does not have is a dead letter saying so; a worker alone
publishes what the broker refused at commit, and takes back the task of a worker killed
mid-run."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tasks import TaskResultStatus
from django_tasks.exceptions import InvalidTaskError
from processes import PrivateRedis, wait_until, worker
from shop.models import Guest
from shop.tasks import fail_with_a_bug, greet, wait_then_greet

from asyncwork import DeadLetter, Job, replay
from asyncwork.backend import job_create
from asyncwork.runner import claim, job_run

in_process_worker = pytest.mark.usefixtures("worker")


def status(result_id: str) -> str:
    return str(greet.get_backend().get_result(result_id).status)


class Abandoned(Exception):
    pass


@in_process_worker
def test_an_enqueue_commits_with_the_callers_data_and_runs_once_it_has() -> None:
    with transaction.atomic():
        Guest.objects.create(name="ada")
        result = greet.enqueue("ada")
        # Written in the caller's transaction, not yet published.
        job = Job.objects.get(pk=result.id)
        assert (job.status, job.published_at) == ("READY", None)
    # Published as the transaction committed, not by the relay (its grace is 10 s).
    job.refresh_from_db()
    assert (job.publish_attempts, job.last_error) == (1, "")
    assert job.published_at is not None
    assert wait_until(lambda: status(result.id) == "SUCCESSFUL")
    done = greet.get_result(result.id)
    assert (done.return_value, done.attempts, done.errors) == (1, 1, [])
    assert done.started_at is not None
    assert done.finished_at is not None
    assert Guest.objects.get(name="ada").greeted == 1


def test_a_run_reads_its_row_whole_and_writes_its_success_in_one_statement(db: None) -> None:
    Guest.objects.create(name="ada")
    due = timezone.now() - timedelta(seconds=1)  # due already: published by the relay, not here
    job = job_create(task="shop.tasks.greet", args=["ada"], kwargs={}, queue="default", due_at=due)
    run = claim(job.pk, lease_seconds=60)
    assert run is not None
    claimed = Job.objects.get(pk=job.pk)
    fields = [field.attname for field in Job._meta.concrete_fields]
    assert {f: getattr(run.job, f) for f in fields} == {f: getattr(claimed, f) for f in fields}
    assert (run.job.status, run.job.attempts, run.job.args) == ("RUNNING", 1, ["ada"])

    second = job_create(
        task="shop.tasks.greet", args=["ada"], kwargs={}, queue="default", due_at=due
    )
    with CaptureQueriesContext(connection) as queries:
        assert job_run(second.pk, lease_seconds=60) == "successful"
    # The claim, the task's own statements, then its success: no transaction block of the runner's
    # (inside this test's transaction, a SAVEPOINT).
    statements = [query["sql"].split()[0] for query in queries.captured_queries]
    assert (statements[0], statements[-1]) == ("UPDATE", "UPDATE")
    assert "SAVEPOINT" not in statements
    done = Job.objects.get(pk=second.pk)
    assert (done.status, done.return_value, done.owner, done.attempts) == ("SUCCESSFUL", 1, "", 1)


def enqueue_then_roll_back() -> None:
    with transaction.atomic():
        Guest.objects.create(name="nobody")
        greet.enqueue("nobody")
        raise Abandoned


@in_process_worker
def test_an_enqueue_rolled_back_never_runs() -> None:
    with pytest.raises(Abandoned):
        enqueue_then_roll_back()
    later = greet.enqueue("ada")  # outside a transaction: committed at once
    assert wait_until(lambda: status(later.id) == "FAILED")  # no guest ada either
    assert list(Job.objects.values_list("args", flat=True)) == [["ada"]]
    assert DeadLetter.objects.get().exception_message == "no guest named ada"


@in_process_worker
def test_a_transient_failure_is_retried_on_the_tasks_policy_each_error_kept() -> None:
    Guest.objects.create(name="bea", failures_left=2)  # the task allows 3 attempts
    result = greet.enqueue("bea")
    assert wait_until(lambda: status(result.id) == "SUCCESSFUL")
    done = greet.get_result(result.id)
    assert done.attempts == 3
    assert [error.exception_class_path for error in done.errors] == [
        "asyncwork.errors.TransientError"
    ] * 2
    assert "bea is not answering" in done.errors[0].traceback
    assert not DeadLetter.objects.exists()


@in_process_worker
def test_failures_past_the_policy_are_failed_and_a_dead_letter_with_their_reason() -> None:
    Guest.objects.create(name="cy", failures_left=5)
    result = greet.enqueue("cy")
    assert wait_until(lambda: status(result.id) == "FAILED")
    assert greet.get_result(result.id).attempts == 3
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.args, letter.attempts) == ("shop.tasks.greet", ["cy"], 3)
    assert (letter.reason, letter.exception_message) == ("exhausted", "cy is not answering")


@in_process_worker
def test_a_bug_fails_at_once_and_its_replay_runs_the_task_again_once() -> None:
    result = fail_with_a_bug.enqueue()
    assert wait_until(lambda: status(result.id) == "FAILED")
    failed = fail_with_a_bug.get_result(result.id)
    assert failed.attempts == 1
    assert [e.exception_class_path for e in failed.errors] == ["builtins.ValueError"]
    letter = DeadLetter.objects.get()
    assert (letter.reason, letter.exception_class) == ("permanent", "builtins.ValueError")

    # The cause fixed (here: a guest who was missing), a replay runs the task again, once.
    missing = greet.enqueue("dan")
    assert wait_until(lambda: status(missing.id) == "FAILED")
    dan = DeadLetter.objects.get(args=["dan"])
    Guest.objects.create(name="dan")
    assert replay(ids=[dan.pk], actor="cli:test").replayed == [dan.pk]
    assert wait_until(lambda: Guest.objects.get(name="dan").greeted == 1)
    again = replay(ids=[dan.pk], actor="cli:test")
    assert (again.replayed, again.skipped) == ([], [dan.pk])
    dan.refresh_from_db()
    assert dan.replay_job is not None
    assert wait_until(lambda: status(str(dan.replay_job.pk)) == "SUCCESSFUL")
    assert Job.objects.filter(task="shop.tasks.greet", args=["dan"]).count() == 2


@in_process_worker
def test_run_after_waits_in_postgresql_then_runs() -> None:
    Guest.objects.create(name="eve")
    due = timezone.now() + timedelta(seconds=3)
    result = greet.using(run_after=due).enqueue("eve")
    job = Job.objects.get(pk=result.id)
    assert (job.due_at, job.published_at) == (due, None)
    time.sleep(1.5)
    assert status(result.id) == "READY"
    assert Job.objects.get(pk=result.id).published_at is None  # not in the broker either
    assert wait_until(lambda: status(result.id) == "SUCCESSFUL", 15)
    assert greet.get_result(result.id).started_at >= due


def test_a_priority_is_refused_with_djangos_own_error() -> None:
    with pytest.raises(InvalidTaskError, match="priority"):
        greet.using(priority=5)


def test_a_result_that_does_not_exist_is_djangos_own_error(db: None) -> None:
    from django_tasks.exceptions import TaskResultDoesNotExist

    with pytest.raises(TaskResultDoesNotExist):
        greet.get_result("4242")
    with pytest.raises(TaskResultDoesNotExist):
        greet.get_result("not a number")


@in_process_worker
def test_a_job_whose_task_the_worker_does_not_have_is_a_dead_letter_saying_so() -> None:
    """The row names a task by its path; a typo, or a task since renamed or removed."""
    with transaction.atomic():
        job = job_create(task="shop.tasks.greeet", args=["ada"], kwargs={}, queue="default")
    assert wait_until(lambda: Job.objects.get(pk=job.pk).status == "FAILED")
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.reason) == ("shop.tasks.greeet", "permanent")
    assert letter.exception_message.startswith("no task shop.tasks.greeet: ")


@in_process_worker
def test_a_message_for_a_celery_task_the_worker_does_not_have_is_a_dead_letter() -> None:
    """Celery would log it and drop it; its replay is refused, saying why."""
    from shop.celery import app

    app.send_task("shop.greet_everyone", args=["ada"], task_id="stray-1")
    assert wait_until(DeadLetter.objects.exists)
    letter = DeadLetter.objects.get()
    assert (letter.task, letter.task_id, letter.args) == ("shop.greet_everyone", "stray-1", ["ada"])
    assert "no Celery task 'shop.greet_everyone' in this worker" in letter.exception_message
    refused = replay(ids=[letter.pk], actor="cli:test")
    assert refused.replayed == []
    assert refused.refused[letter.pk].startswith("no task shop.greet_everyone: ")


@pytest.mark.django_db(transaction=True)
def test_a_worker_alone_publishes_what_the_broker_refused_at_commit(tmp_path: Path) -> None:
    """The broker down at commit: the code that committed is not held up, the row waits; once
    the broker is back, a worker (nothing else runs) publishes and runs it."""
    broker = PrivateRedis()
    try:
        broker.start()
        with worker(tmp_path, broker=broker.url):
            broker.stop()
            Guest.objects.create(name="fay")
            started = time.monotonic()
            with override_broker(broker.url), transaction.atomic():
                result = greet.enqueue("fay")
            held_up = time.monotonic() - started
            assert held_up < 1.5, held_up
            job = Job.objects.get(pk=result.id)
            assert (job.published_at, job.publish_attempts) == (None, 1)
            assert job.last_error
            broker.start()
            back = time.monotonic()
            assert wait_until(lambda: status(result.id) == "SUCCESSFUL", 45)
            assert time.monotonic() - back < 30
    finally:
        broker.remove()
    assert Guest.objects.get(name="fay").greeted == 1


@pytest.mark.django_db(transaction=True)
def test_a_task_whose_worker_is_killed_mid_run_runs_again_on_another(tmp_path: Path) -> None:
    Guest.objects.create(name="gus")
    first = worker(tmp_path, name="first")
    with first as doomed:
        result = wait_then_greet.enqueue("gus", 30)
        assert wait_until(lambda: Guest.objects.get(name="gus").failures_left == 100)
        doomed.kill()
    job = Job.objects.get(pk=result.id)
    assert (job.status, job.attempts) == ("RUNNING", 1)
    with worker(tmp_path, name="second"):
        # The dead process's heartbeat lapses; the second worker's poll gives the job back
        # and runs it.
        Job.objects.filter(pk=job.pk).update(args=["gus", 0])
        assert wait_until(lambda: status(result.id) == "SUCCESSFUL", 60)
    done = wait_then_greet.get_result(result.id)
    assert done.attempts == 2
    assert len(set(done.worker_ids)) == 2
    assert Guest.objects.get(name="gus").greeted == 1


def override_broker(url: str) -> object:
    from celery import current_app

    from asyncwork import backend

    class _Broker:
        def __enter__(self) -> None:
            self.before = current_app.conf.broker_url
            current_app.conf.broker_url = url
            backend._producer_drop()

        def __exit__(self, *_: object) -> None:
            current_app.conf.broker_url = self.before
            backend._producer_drop()

    return _Broker()


assert TaskResultStatus.SUCCESSFUL == "SUCCESSFUL"
