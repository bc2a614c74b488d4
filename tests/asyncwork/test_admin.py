"""The admin of the async machinery: jobs are read-only and published again through the
service, onto the real broker; the periodic tasks page shows what each job did and who holds
its lock. Each action needs its permission: a viewer sees every page and no action. Every
action is recorded as an operator action, listed read-only and shown on the row's page."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from asyncwork import backend, broker, deadletters
from asyncwork.backend import RUN, message_id, relay
from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.periodic import jobs
from asyncwork.models import DeadLetter, Job, ScheduledJob
from core.celery import app
from invoicing.tasks import send_invoice_email
from stack.net import free_port
from tests.helpers.admin import (
    EMPTY,
    action_choices,
    admin_as,
    form_data,
    messages,
    rows,
    run_action,
)
from tests.helpers.factories import paid_invoice, staff_user
from tests.tasks import divide

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/admin/asyncwork/job/"
DEAD_LETTERS = "/admin/asyncwork/deadletter/"
ACTIONS = "/admin/operators/operatoraction/"
PERIODIC = "/admin/django_celery_beat/periodictask/"
# A task the code has (a replay of one it lacks is refused), with no replay check of its own.
TASK = divide.module_path


@pytest.fixture
def superuser() -> Client:
    return admin_as(
        get_user_model().objects.create_superuser("root", "root@example.com", "pw-12345-long")
    )


def letter(task_id: str = "t1") -> DeadLetter:
    return DeadLetter.objects.create(
        task=TASK,
        task_id=task_id,
        args=[1, 0],
        queue="email",
        reason="permanent",
        attempts=1,
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )


@pytest.fixture
def queue() -> Any:
    """A queue of this test's own on the real broker; ``queue.messages()`` reads what was
    published to it again: the queue read ahead of it (``asyncwork.broker.ahead``)."""
    name = f"admintest-{uuid.uuid4().hex[:8]}"
    key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + broker.ahead(name)
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)

    class Queue(str):
        def messages(self) -> list[dict[str, Any]]:
            return [json.loads(raw) for raw in client.lrange(key, 0, -1)]

    yield Queue(name)
    client.delete(key)
    client.close()


def job(queue: str, *, published: bool, **fields: Any) -> Job:
    row = Job.objects.create(task=TASK, args=[1, 0], queue=queue)
    if published:
        # Published an hour ago, and since lost by the broker (a restart without persistence).
        fields = {
            "published_at": timezone.now() - timedelta(hours=1),
            "publish_attempts": 1,
            **fields,
        }
    Job.objects.filter(pk=row.pk).update(**fields)
    row.refresh_from_db()
    return row


def test_job_pages_render_read_only_and_list_the_unpublished(staff: Client, queue: str) -> None:
    sent = job(queue, published=True)
    stuck = job(queue, published=False, publish_attempts=3, last_error="TimeoutError('x')")
    done = job(queue, published=True, status=Job.Status.SUCCESSFUL)

    listed = {row["id"]: row for row in rows(staff.get(JOBS))}
    assert listed[str(sent.pk)]["published_at"] != EMPTY
    assert listed[str(stuck.pk)]["published_at"] == EMPTY
    assert listed[str(stuck.pk)]["last_error_short"] == "TimeoutError('x')"
    assert listed[str(sent.pk)]["queue"] == queue
    assert listed[str(sent.pk)]["task"] == TASK
    assert (listed[str(sent.pk)]["status"], listed[str(done.pk)]["status"]) == (
        "Ready",
        "Successful",
    )
    # What the dashboard's outbox figure links: the jobs waiting to be published.
    unpublished = {"status": "READY", "published_at__isnull": "True"}
    assert [row["id"] for row in rows(staff.get(JOBS, unpublished))] == [str(stuck.pk)]
    assert [row["id"] for row in rows(staff.get(JOBS, {"status": "SUCCESSFUL"}))] == [str(done.pk)]

    detail = staff.get(f"{JOBS}{stuck.pk}/change/")
    assert detail.status_code == 200
    assert b"TimeoutError(&#x27;x&#x27;)" in detail.content
    assert b'name="_save"' not in detail.content  # read-only: no save button
    assert staff.get(f"{JOBS}add/").status_code == 403


def test_republish_puts_lost_and_unpublished_jobs_on_the_broker(staff: Client, queue: Any) -> None:
    lost = job(queue, published=True)
    stuck = job(queue, published=False)
    assert queue.messages() == []
    before = timezone.now()

    response = run_action(staff, JOBS, "republish_selected", [lost.pk, stuck.pk])

    assert messages(response) == [("success", "Published 2 job(s) again.")]
    on_broker = queue.messages()
    assert sorted(m["headers"]["id"] for m in on_broker) == sorted(
        message_id(pk) for pk in (lost.pk, stuck.pk)
    )
    # The one Celery task that runs jobs, shown under the job's own task.
    assert {(m["headers"]["task"], m["headers"]["shadow"]) for m in on_broker} == {(RUN, TASK)}
    # The message carries the job's id alone (kombu's envelope: the body in base64).
    bodies = [json.loads(base64.b64decode(m["body"])) for m in on_broker]
    assert sorted(args for args, _, _ in bodies) == sorted([[lost.pk], [stuck.pk]])
    assert [kwargs for _, kwargs, _ in bodies] == [{}, {}]
    for row, attempts in ((lost, 2), (stuck, 1)):
        row.refresh_from_db()
        assert row.published_at is not None
        assert row.published_at >= before
        assert row.publish_attempts == attempts
    recorded = OperatorAction.objects.order_by("target_id")
    assert [(a.action, a.actor, a.target, a.detail) for a in recorded] == [
        ("job.republish", "admin:op", lost, "published"),
        ("job.republish", "admin:op", stuck, "published"),
    ]


def test_republish_leaves_a_job_that_started_or_finished(staff: Client, queue: Any) -> None:
    """Published again only while it has not started: a running or finished job's message
    would only find its claim (``asyncwork.runner``)."""
    running = job(queue, published=True, status=Job.Status.RUNNING)
    finished = job(queue, published=True, status=Job.Status.SUCCESSFUL)

    response = run_action(staff, JOBS, "republish_selected", [running.pk, finished.pk])

    assert messages(response)[0] == ("success", "Published 0 job(s) again.")
    assert messages(response)[1][0] == "warning"
    assert messages(response)[1][1].startswith("Not published: 2 (started or done")
    assert queue.messages() == []
    for row in (running, finished):
        before = row.publish_attempts
        row.refresh_from_db()
        assert row.publish_attempts == before


def test_republish_skips_a_row_another_publisher_holds_and_says_so(
    staff: Client, queue: Any
) -> None:
    held, free = job(queue, published=True), job(queue, published=True)
    locked, release = threading.Event(), threading.Event()

    def publisher() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(20)
        finally:
            connection.close()

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        assert locked.wait(10)
        response = run_action(staff, JOBS, "republish_selected", [held.pk, free.pk])
    finally:
        release.set()
        thread.join(20)

    assert messages(response)[0] == ("success", "Published 1 job(s) again.")
    assert messages(response)[1][0] == "warning"
    assert messages(response)[1][1].startswith("Not published: 1 (started or done, held by")
    assert [m["headers"]["id"] for m in queue.messages()] == [message_id(free.pk)]
    held.refresh_from_db()
    assert held.publish_attempts == 1  # untouched
    assert dict(OperatorAction.objects.values_list("target_id", "detail")) == {
        str(held.pk): "skipped: another publisher holds it",
        str(free.pk): "published",
    }


@pytest.mark.slow
def test_a_republish_the_broker_refuses_leaves_the_row_to_the_relay(
    staff: Client, queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = job(queue, published=True)
    nothing_listens = f"redis://127.0.0.1:{free_port()}/0"
    refused = app.amqp.Producer(app.connection_for_write(nothing_listens), auto_declare=False)
    monkeypatch.setattr(backend, "_producer", lambda: refused)

    response = run_action(staff, JOBS, "republish_selected", [lost.pk])

    assert messages(response)[0] == ("success", "Published 0 job(s) again.")
    assert messages(response)[1][0] == "warning"
    lost.refresh_from_db()
    assert lost.published_at is None  # the relay's again
    assert lost.publish_attempts == 2
    assert "onnect" in lost.last_error
    assert queue.messages() == []
    recorded = OperatorAction.objects.get()
    assert recorded.target == lost
    assert recorded.detail.startswith("broker refused, left to the relay: ")

    monkeypatch.undo()
    assert relay(grace=timedelta(0)) == 1
    assert [m["headers"]["id"] for m in queue.messages()] == [message_id(lost.pk)]


# A scheduled job of the machinery's own (asyncwork.contrib.periodic.retention); here its body
# is the test's, its lock and its row the job's.
HELD_JOB = "retention-purge"


def test_periodic_tasks_show_each_jobs_last_run_last_skip_and_lock_holder(staff: Client) -> None:
    call_command("setup_periodic_tasks", stdout=StringIO())
    inside, release = threading.Event(), threading.Event()
    # The process running the job (this one), not the PostgreSQL backend serving its lock.
    holder = f"pid {os.getpid()} on host {socket.gethostname()}"

    def running_job() -> None:
        def body() -> str:
            inside.set()
            release.wait(20)
            return "done"

        try:
            jobs.job_run(name=HELD_JOB, body=body)
        finally:
            connection.close()

    thread = threading.Thread(target=running_job)
    thread.start()
    try:
        assert inside.wait(10)
        # A second run while the first holds the lock: skipped.
        jobs.job_task(HELD_JOB).apply().get()
        listed = {row["name"]: row for row in rows(staff.get(PERIODIC))}
        task = PeriodicTask.objects.get(name=HELD_JOB)
        detail = staff.get(f"{PERIODIC}{task.pk}/change/")
    finally:
        release.set()
        thread.join(20)

    held = listed[HELD_JOB]
    assert held["job_lock_holder"] == holder
    assert held["job_last_run"] != EMPTY
    assert held["job_last_skip"] != EMPTY
    idle = listed["dlq-alert"]  # never ran here
    assert (idle["job_last_run"], idle["job_last_skip"], idle["job_lock_holder"]) == (EMPTY,) * 3
    assert detail.status_code == 200
    assert holder.encode() in detail.content
    assert b"Job last skipped" in detail.content
    scheduled = ScheduledJob.objects.get(name=HELD_JOB)
    assert (scheduled.runs, scheduled.skips) == (1, 1)
    # Released: nobody holds it any more.
    assert rows(staff.get(PERIODIC, {"q": HELD_JOB}))[0]["job_lock_holder"] == EMPTY


def test_django_celery_beats_own_actions_still_work(superuser: Client) -> None:
    call_command("setup_periodic_tasks", stdout=StringIO())
    task = PeriodicTask.objects.get(name="dlq-alert")
    response = run_action(superuser, PERIODIC, "disable_tasks", [task.pk])
    assert messages(response) == [("info", "1 task was successfully disabled")]
    task.refresh_from_db()
    assert task.enabled is False


def test_beats_own_actions_need_the_change_permission(viewer: Client, staff: Client) -> None:
    """django-celery-beat declares no permission on its actions: without the change
    permission, neither a viewer nor an operator may disable a schedule or run a job."""
    call_command("setup_periodic_tasks", stdout=StringIO())
    task = PeriodicTask.objects.get(name="dlq-alert")
    for client in (viewer, staff):
        assert rows(client.get(PERIODIC))  # they see the schedules
        assert action_choices(client.get(PERIODIC)) == []
        assert messages(run_action(client, PERIODIC, "disable_tasks", [task.pk])) == []
    task.refresh_from_db()
    assert task.enabled is True
    scheduler = admin_as(
        staff_user(
            "scheduler",
            perms=[
                "django_celery_beat.view_periodictask",
                "django_celery_beat.change_periodictask",
            ],
        )
    )
    assert set(action_choices(scheduler.get(PERIODIC))) == {
        "enable_tasks",
        "disable_tasks",
        "toggle_tasks",
        "run_tasks",
    }


def test_scheduled_jobs_page_renders(staff: Client) -> None:
    jobs.job_task("dlq-alert").apply().get()
    listed = rows(staff.get("/admin/asyncwork/scheduledjob/"))
    # Every declared job has its row from migrate on
    # (asyncwork.contrib.periodic.jobs.schedules_sync).
    assert sorted((row["name"], row["runs"], row["running_now"]) for row in listed) == sorted(
        (s.name, "1" if s.name == "dlq-alert" else "0", EMPTY) for s in jobs.jobs_declared()
    )


def test_a_viewer_sees_every_page_and_no_action(viewer: Client, queue: Any) -> None:
    waiting, stuck = letter(), job(queue, published=False)

    assert [row["id"] for row in rows(viewer.get(DEAD_LETTERS))] == [str(waiting.pk)]
    assert [row["id"] for row in rows(viewer.get(JOBS))] == [str(stuck.pk)]
    for url in (DEAD_LETTERS, JOBS, ACTIONS, PERIODIC, "/admin/asyncwork/scheduledjob/"):
        assert action_choices(viewer.get(url)) == [], url
    assert viewer.get(f"{DEAD_LETTERS}{waiting.pk}/change/").status_code == 200
    assert viewer.get(f"{JOBS}{stuck.pk}/change/").status_code == 200

    # Posting the action anyway runs nothing: the list comes back, without a word.
    assert messages(run_action(viewer, DEAD_LETTERS, "replay_selected", [waiting.pk])) == []
    assert messages(run_action(viewer, JOBS, "republish_selected", [stuck.pk])) == []
    waiting.refresh_from_db()
    assert waiting.replayed_at is None
    assert queue.messages() == []
    assert not OperatorAction.objects.exists()


def test_each_power_offers_its_own_action_only(queue: Any) -> None:
    letter(), job(queue, published=False)  # an empty list offers no action at all
    views = ["asyncwork.view_deadletter", "asyncwork.view_job"]
    replayer = admin_as(staff_user("replayer", perms=[*views, "asyncwork.replay_deadletter"]))
    assert action_choices(replayer.get(DEAD_LETTERS)) == ["replay_selected"]
    assert action_choices(replayer.get(JOBS)) == []
    resolver = admin_as(staff_user("resolver", perms=[*views, "asyncwork.resolve_deadletter"]))
    assert action_choices(resolver.get(DEAD_LETTERS)) == ["resolve_selected", "unresolve_selected"]
    republisher = admin_as(staff_user("republisher", perms=[*views, "asyncwork.republish_job"]))
    assert action_choices(republisher.get(DEAD_LETTERS)) == []
    assert action_choices(republisher.get(JOBS)) == ["republish_selected"]


def confirmed(client: Client, action: str, pks: list[Any], button: str = "confirm") -> Any:
    """Choose ``action`` for ``pks``, then submit its confirmation page with ``button``."""
    page = run_action(client, DEAD_LETTERS, action, pks)
    return client.post(
        DEAD_LETTERS, {**form_data(page, "confirmation-form"), button: "1"}, follow=True
    )


def test_a_replay_is_recorded_once_and_shown_on_the_dead_letter(staff: Client) -> None:
    waiting = letter()
    assert action_choices(staff.get(DEAD_LETTERS)) == [
        "replay_selected",
        "resolve_selected",
        "unresolve_selected",
    ]

    page = run_action(staff, DEAD_LETTERS, "replay_selected", [waiting.pk])
    assert "Replay <strong>1</strong> dead letter:" in page.content.decode()
    assert not OperatorAction.objects.exists()  # asked first, nothing done yet
    response = staff.post(
        DEAD_LETTERS, {**form_data(page, "confirmation-form"), "confirm": "1"}, follow=True
    )

    assert messages(response) == [("success", "Replayed 1 dead letter(s).")]
    waiting.refresh_from_db()
    recorded = OperatorAction.objects.get()
    assert (recorded.action, recorded.actor, recorded.target) == (
        "dead_letter.replay",
        "admin:op",
        waiting,
    )
    assert recorded.detail == f"replayed: the job is job {waiting.replay_job_id}"
    page = staff.get(f"{DEAD_LETTERS}{waiting.pk}/change/").content.decode()
    # The page's title names the job as a call, with no Python tuple in it.
    assert f"dead letter #{waiting.pk} {TASK}(1, 0) (permanent)" in page
    assert "(1, 0,)" not in page
    assert "Operator actions" in page
    assert "dead_letter.replay" in page
    assert "admin:op" in page


def test_resolving_asks_why_on_a_page_with_the_count_then_files_the_letters_apart(
    staff: Client,
) -> None:
    first, second, other = letter("t1"), letter("t2"), letter("t3")

    page = run_action(staff, DEAD_LETTERS, "resolve_selected", [first.pk, second.pk])
    text = page.content.decode()
    assert "Resolve <strong>2</strong> dead letters" in text
    assert 'name="why"' in text
    assert DeadLetter.objects.filter(resolved_at__isnull=False).count() == 0

    # Confirmed without a reason: the page again, nothing resolved.
    chosen = {"action": "resolve_selected", "_selected_action": [first.pk, second.pk]}
    again = staff.post(DEAD_LETTERS, {**chosen, "confirm": "1", "why": " "}, follow=True)
    assert 'name="why"' in again.content.decode()
    assert DeadLetter.objects.filter(resolved_at__isnull=False).count() == 0

    done = staff.post(
        DEAD_LETTERS, {**chosen, "confirm": "1", "why": "refunded by hand"}, follow=True
    )
    assert messages(done) == [("success", "Resolved 2 dead letter(s).")]
    assert [row["id"] for row in rows(staff.get(f"{DEAD_LETTERS}?replayed=no"))] == [str(other.pk)]
    resolved = rows(staff.get(f"{DEAD_LETTERS}?replayed=resolved"))
    assert sorted(row["id"] for row in resolved) == sorted([str(first.pk), str(second.pk)])
    assert all(
        row["replayed_at"].startswith("resolved by admin:op at ")
        and row["replayed_at"].endswith(": refunded by hand")
        for row in resolved
    )
    assert sorted(OperatorAction.objects.values_list("action", "detail")) == [
        ("dead_letter.resolve", "resolved: refunded by hand"),
        ("dead_letter.resolve", "resolved: refunded by hand"),
    ]
    # The page of a resolved letter offers no Replay button; unresolving brings it back.
    assert 'class="replay"' not in staff.get(f"{DEAD_LETTERS}{first.pk}/change/").content.decode()
    undone = confirmed(staff, "unresolve_selected", [first.pk])
    assert messages(undone) == [("success", "1 dead letter(s) wait again.")]
    assert 'class="replay"' in staff.get(f"{DEAD_LETTERS}{first.pk}/change/").content.decode()


def test_operator_actions_are_listed_read_only_with_filters_and_links(staff: Client) -> None:
    first, second = letter("t1"), letter("t2")
    confirmed(staff, "replay_selected", [first.pk])
    call_command("dlq", "replay", str(second.pk), stdout=StringIO())

    listed = rows(staff.get(ACTIONS))
    assert [(row["action"], row["actor"].split(":")[0]) for row in listed] == [
        ("dead_letter.replay", "cli"),
        ("dead_letter.replay", "admin"),
    ]
    assert [row["actor"] for row in rows(staff.get(ACTIONS, {"via": "admin"}))] == ["admin:op"]
    assert len(rows(staff.get(ACTIONS, {"action": "dead_letter.replay"}))) == 2
    assert rows(staff.get(ACTIONS, {"action": "job.republish"})) == []
    assert [row["target_link"] for row in rows(staff.get(ACTIONS, {"q": "cli:"}))] == [str(second)]
    page = staff.get(ACTIONS).content.decode()
    assert f'href="{DEAD_LETTERS}{first.pk}/change/"' in page

    recorded = OperatorAction.objects.get(target_id=str(first.pk))
    detail = staff.get(f"{ACTIONS}{recorded.pk}/change/")
    assert detail.status_code == 200
    assert b'name="_save"' not in detail.content
    assert staff.get(f"{ACTIONS}add/").status_code == 403
    assert staff.post(f"{ACTIONS}{recorded.pk}/delete/").status_code == 403
    assert action_choices(staff.get(ACTIONS)) == []


def test_a_page_of_dead_letters_describes_its_rows_in_one_go(staff: Client) -> None:
    """What each row was about is read once per kind of job on the page, however many rows
    there are (the invoicing app's describer: one query for all the page's invoices)."""

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            listed = rows(staff.get(DEAD_LETTERS))
        assert all(row["subject_link"].startswith("invoice ") for row in listed)
        return len(captured)

    def invoice_letter(n: int) -> None:
        invoice = paid_invoice()
        DeadLetter.objects.create(
            task=send_invoice_email.module_path,
            task_id=f"page-{n}",
            args=[invoice.pk],
            queue="email",
            reason="permanent",
            attempts=1,
            first_failed_at=timezone.now(),
            last_failed_at=timezone.now(),
        )

    invoice_letter(0)
    queries()  # the first request also reads the user's permissions
    one = queries()
    for n in range(1, 40):
        invoice_letter(n)
    assert queries() == one


def test_a_describer_that_fails_leaves_the_dead_letters_readable(
    staff: Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(letters: Any) -> Any:
        raise RuntimeError("the domain's lookup broke")

    monkeypatch.setitem(deadletters._describers, TASK, broken)
    waiting = letter()
    DeadLetter.objects.filter(pk=waiting.pk).update(exception_message="it broke")

    [row] = rows(staff.get(DEAD_LETTERS))
    page = staff.get(f"{DEAD_LETTERS}{waiting.pk}/change/")

    assert (row["subject_link"], row["recipient"], row["failure"]) == (
        f"{TASK}(1, 0)",
        EMPTY,
        "it broke",
    )
    assert page.status_code == 200
    assert f"describing the dead letters of {TASK} failed" in caplog.text
