"""Dead letters in bulk, and replays checked first, through each door: the API's bulk endpoint
(by id or by filter, a dry run, once per Idempotency-Key, each action's own power), a single
replay refused with 409 unless forced, the admin's actions each asking first on a page with the
count (a replay listing the refused and why, with Replay anyway, as the dead letter's own
button does), what became of a replayed job on the list and the page, and the command line's
bad input as a non-zero exit. Bounded: a request (the API's, the admin's "select all" included)
acts on at most BULK_LIMIT, in a transaction whose statements time out, and beyond it points to
``manage.py dlq``, which commits a batch at a time; 20,000 after an outage, through a real
gunicorn and the real command, are each replayed once. The replay check and describer are
declared here, for a test task."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import requests
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from asyncwork import deadletters
from asyncwork.audit import operator_acted
from asyncwork.backend import message_id
from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.operators.tokens import api_token_create
from asyncwork.deadletters import (
    BULK_LIMIT,
    Subject,
    describer,
    replay_check,
    selection,
)
from asyncwork.management.commands.dlq import BATCH
from asyncwork.models import DeadLetter, IdempotencyRecord, Job
from stack import launch
from stack.net import HOST
from tests.helpers.admin import admin_as, api_as, form_data, messages, rows, run_action
from tests.helpers.factories import staff_user
from tests.helpers.processes import python, worker_env
from tests.tasks import divide

pytestmark = pytest.mark.django_db

BULK = "/api/dead-letters/bulk/"
DEAD_LETTERS = "/admin/asyncwork/deadletter/"
DIVIDE = divide.module_path
BY_ZERO = "it divides by zero again: its arguments cannot change, so resolve it"


def letter(task_id: str, *, args: list[Any] | None = None, **fields: Any) -> DeadLetter:
    values: dict[str, Any] = {
        "task": DIVIDE,
        "args": [1, 0] if args is None else args,
        "queue": "default",
        "reason": "permanent",
        "exception_message": "division by zero",
        "attempts": 1,
        "first_failed_at": timezone.now(),
        "last_failed_at": timezone.now(),
        **fields,
    }
    return DeadLetter.objects.create(task_id=task_id, **values)


@pytest.fixture
def checked() -> Iterator[None]:
    """The division's replay check: a zero denominator fails again, whatever is fixed."""

    @replay_check(divide)
    def by_zero(letters: Sequence[DeadLetter]) -> dict[int, str]:
        return {letter.pk: BY_ZERO for letter in letters if letter.args[1] == 0}

    yield
    deadletters._replay_checks.pop(DIVIDE)


@pytest.fixture
def operator() -> APIClient:
    return api_as(staff_user("op", groups=["operators"]))


def bulk(client: APIClient, body: dict[str, Any], key: str | None = "key-1") -> Any:
    if key is None:
        return client.post(BULK, body, format="json")
    return client.post(BULK, body, format="json", headers={"Idempotency-Key": key})


def test_bulk_replay_by_filter_once_per_key(operator: APIClient) -> None:
    chosen = [letter("t1"), letter("t2", args=[4, 2])]
    other = letter("t3", reason="exhausted")
    body = {"action": "replay", "reason": "permanent"}

    first = bulk(operator, body)

    assert first.status_code == 200
    assert first.json() == {
        "action": "replay",
        "dry_run": False,
        "selected": 2,
        "replayed": [x.pk for x in chosen],
        "skipped": [],
        "refused": [],
        "forced": [],
    }
    assert "Idempotent-Replayed" not in first
    other.refresh_from_db()
    assert other.replayed_at is None
    assert {a.target for a in OperatorAction.objects.all()} == set(chosen)
    assert all(a.actor == "api:op" for a in OperatorAction.objects.all())

    # The same request again under its key: the first answer, nothing more done.
    letter("t4")  # would be selected by a new request
    again = bulk(operator, body)
    assert (again.status_code, again.json(), again["Idempotent-Replayed"]) == (
        200,
        first.json(),
        "true",
    )
    assert OperatorAction.objects.count() == 2
    assert Job.objects.count() == 2
    # The same key for another request: refused, nothing done.
    reused = bulk(operator, {"action": "replay", "reason": "exhausted"})
    assert reused.status_code == 422
    assert "already used for another request" in reused.json()["detail"]
    assert OperatorAction.objects.count() == 2


def test_bulk_needs_an_idempotency_key_except_for_a_dry_run(operator: APIClient) -> None:
    waiting = letter("t1")
    missing = bulk(operator, {"action": "replay", "ids": [waiting.pk]}, key=None)
    assert (missing.status_code, missing.json()) == (
        400,
        {"Idempotency-Key": "this header is required"},
    )
    dry = bulk(operator, {"action": "replay", "ids": [waiting.pk], "dry_run": True}, key=None)
    assert dry.status_code == 200
    waiting.refresh_from_db()
    assert waiting.replayed_at is None
    assert not OperatorAction.objects.exists()


def test_a_dry_run_needs_the_view_permission_only_and_records_nothing(checked: None) -> None:
    refused, fine = letter("t1"), letter("t2", args=[4, 2])
    done = letter("t3", args=[9, 3], replayed_at=timezone.now())
    viewer = api_as(staff_user("watcher", groups=["viewers"]))

    answer = bulk(viewer, {"action": "replay", "task": DIVIDE, "dry_run": True})
    forced = bulk(viewer, {"action": "replay", "all": True, "dry_run": True, "force": True})
    resolve = bulk(viewer, {"action": "resolve", "ids": [done.pk, fine.pk], "dry_run": True})

    assert answer.status_code == 200
    assert answer.json() == {
        "action": "replay",
        "dry_run": True,
        "selected": 2,
        "ids": [refused.pk, fine.pk],  # still waiting only
        "refused": [{"id": refused.pk, "detail": BY_ZERO}],
    }
    assert forced.json()["forced"] == [{"id": refused.pk, "detail": BY_ZERO}]
    assert resolve.json() == {
        "action": "resolve",
        "dry_run": True,
        "selected": 2,
        "ids": [fine.pk, done.pk],
    }
    assert not OperatorAction.objects.exists()
    assert not IdempotencyRecord.objects.exists()
    assert not Job.objects.exists()
    # Acting needs the power.
    acting = bulk(viewer, {"action": "replay", "task": DIVIDE})
    assert acting.status_code == 403
    assert "asyncwork.replay_deadletter" in acting.json()["detail"]
    assert not OperatorAction.objects.exists()


@pytest.mark.parametrize(
    ("perms", "replay", "resolve"),
    [
        (["asyncwork.replay_deadletter"], 403, 403),  # a power without the view
        (["asyncwork.view_deadletter", "asyncwork.replay_deadletter"], 200, 403),
        (["asyncwork.view_deadletter", "asyncwork.resolve_deadletter"], 403, 200),
    ],
)
def test_bulk_needs_the_power_of_its_action(perms: list[str], replay: int, resolve: int) -> None:
    first, second = letter("t1", args=[2, 1]), letter("t2", args=[4, 1])
    client = api_as(staff_user("someone", perms=perms))

    replayed = bulk(client, {"action": "replay", "ids": [first.pk]}, key="a")
    resolved = bulk(client, {"action": "resolve", "ids": [second.pk], "why": "a test"}, key="b")

    assert (replayed.status_code, resolved.status_code) == (replay, resolve)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.replayed_at is not None) == (replay == 200)
    assert (second.resolved_at is not None) == (resolve == 200)
    if resolve == 200:
        assert resolved.json() == {
            "action": "resolve",
            "dry_run": False,
            "selected": 1,
            "resolved": [second.pk],
            "skipped": [],
        }
        assert second.resolved_why == "a test"


def test_bulk_reports_the_refused_and_force_replays_them(
    operator: APIClient, checked: None
) -> None:
    refused, fine = letter("t1"), letter("t2", args=[4, 2])
    resolved = letter("t3", resolved_at=timezone.now(), resolved_by="x", resolved_why="y")
    ids = [refused.pk, fine.pk, resolved.pk]

    answer = bulk(operator, {"action": "replay", "ids": ids}, key="a").json()

    assert answer["replayed"] == [fine.pk]
    assert answer["refused"] == [{"id": refused.pk, "detail": BY_ZERO}]
    assert answer["skipped"] == [
        {"id": resolved.pk, "detail": "resolved; unresolve it to replay it"}
    ]
    forced = bulk(operator, {"action": "replay", "ids": [refused.pk], "force": True}, key="b")
    assert forced.json()["replayed"] == [refused.pk]
    assert forced.json()["forced"] == [{"id": refused.pk, "detail": BY_ZERO}]
    recorded = OperatorAction.objects.filter(target_id=str(refused.pk)).order_by("pk")
    assert [a.detail for a in recorded] == [
        f"refused: {BY_ZERO}",
        f"replayed: the job is job {Job.objects.latest('pk').pk}; "
        f"forced past its check, which said: {BY_ZERO}",
    ]


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        ({}, {"action": ["This field is required."]}),
        ({"action": "purge", "all": True}, {"action": ['"purge" is not a valid choice.']}),
        (
            {"action": "replay"},
            {
                "ids": [
                    "say which dead letters: ids, filters (reason, task, since, until), or "
                    "all: true (replay)"
                ]
            },
        ),
        (
            {"action": "replay", "ids": [1], "reason": "permanent"},
            {"ids": ["give ids, or filters (reason, task, since, until), or all: one of them"]},
        ),
        (
            {"action": "replay", "all": True, "task": DIVIDE},
            {"all": ["all is every dead letter still waiting: no filters"]},
        ),
        (
            {"action": "replay", "reason": "lost"},
            {
                "reason": [
                    "'lost' is not one of permanent, exhausted, provider_unavailable, "
                    "redelivery_limit"
                ]
            },
        ),
        (
            {"action": "replay", "since": "last week"},
            {
                "since": [
                    "'last week' is not an ISO date or date and time: 2026-12-03, "
                    "2026-12-03T17:00, 2026-12-03T17:00+01:00"
                ]
            },
        ),
        (
            {"action": "resolve", "since": "2026-12-03", "until": "2026-12-01", "why": "x"},
            {"until": ["must be later than since: nothing is in between"]},
        ),
        ({"action": "resolve", "task": DIVIDE}, {"why": ["say why the jobs will not be run"]}),
        (
            {"action": "resolve", "task": DIVIDE, "why": " "},
            {"why": ["say why the jobs will not be run"]},
        ),
        ({"action": "resolve", "all": True, "why": "x"}, {"all": ["resolve takes ids or filters"]}),
        (
            {"action": "resolve", "task": DIVIDE, "why": "x", "force": True},
            {"force": ["only with action replay"]},
        ),
        (
            {"action": "replay", "task": DIVIDE, "why": "x"},
            {"why": ["only with action resolve"]},
        ),
        ({"action": "replay", "ids": []}, {"ids": ["This list may not be empty."]}),
        ({"action": "replay", "ids": ["one"]}, {"ids": {"0": ["A valid integer is required."]}}),
        ({"action": "replay", "all": "maybe"}, {"all": ["Must be a valid boolean."]}),
        (
            {"action": "replay", "all": True, "dry_run": "x"},
            {"dry_run": ["Must be a valid boolean."]},
        ),
    ],
)
def test_bulk_refuses_bad_input_with_each_fields_reason(
    operator: APIClient, body: dict[str, Any], errors: dict[str, Any]
) -> None:
    waiting = letter("t1")
    answer = bulk(operator, body)
    assert (answer.status_code, answer.json()) == (400, errors)
    waiting.refresh_from_db()
    assert (waiting.replayed_at, waiting.resolved_at) == (None, None)
    assert not IdempotencyRecord.objects.exists()


def test_bulk_with_an_unknown_id_is_a_400_and_leaves_the_key_unused(operator: APIClient) -> None:
    waiting = letter("t1")
    answer = bulk(operator, {"action": "replay", "ids": [waiting.pk, 424242]})
    assert (answer.status_code, answer.json()) == (400, {"ids": ["no dead letter with id 424242"]})
    waiting.refresh_from_db()
    assert waiting.replayed_at is None
    assert not IdempotencyRecord.objects.exists()
    assert not OperatorAction.objects.exists()
    # The key is free for the corrected request.
    assert bulk(operator, {"action": "replay", "ids": [waiting.pk]}).json()["replayed"] == [
        waiting.pk
    ]


def test_a_single_replay_refused_is_a_409_with_the_reason_unless_forced(
    operator: APIClient, checked: None
) -> None:
    refused = letter("t1")
    url = f"/api/dead-letters/{refused.pk}/replay/"

    answer = operator.post(url)

    assert answer.status_code == 409
    assert answer.json() == {
        "id": refused.pk,
        "replayed": False,
        "detail": f"not replayed: {BY_ZERO} (to replay it anyway: force)",
        "refused": BY_ZERO,
    }
    refused.refresh_from_db()
    assert refused.replayed_at is None
    assert operator.post(url, {"force": "maybe"}, format="json").json() == {
        "force": ["Must be a valid boolean."]
    }
    forced = operator.post(url, {"force": True}, format="json")
    assert forced.status_code == 200
    assert forced.json() == {
        "id": refused.pk,
        "replayed": True,
        "detail": f"replayed by force, past its check: {BY_ZERO}",
    }
    refused.refresh_from_db()
    assert refused.replayed_by == "api:op"


def test_the_schema_describes_the_bulk_endpoint_and_force(operator: APIClient) -> None:
    schema = operator.get("/api/schema/?format=json").json()
    post = schema["paths"]["/api/dead-letters/bulk/"]["post"]
    assert {p["name"] for p in post["parameters"]} == {"Idempotency-Key"}
    assert {"200", "400", "403", "422"} <= set(post["responses"])
    request = schema["components"]["schemas"]["BulkRequest"]["properties"]
    assert set(request) == {
        "action",
        "ids",
        "all",
        "reason",
        "task",
        "since",
        "until",
        "why",
        "dry_run",
        "force",
    }
    replay = schema["paths"]["/api/dead-letters/{id}/replay/"]["post"]
    assert "409" in replay["responses"]
    assert "force" in schema["components"]["schemas"]["ReplayRequest"]["properties"]


# The admin


def submitted(client: Client, page: Any, button: str, url: str = DEAD_LETTERS) -> Any:
    """Submit the confirmation page's form with ``button``."""
    return client.post(url, {**form_data(page, "confirmation-form"), button: "1"}, follow=True)


def test_replaying_a_selection_asks_first_listing_the_refused_and_why(
    staff: Client, checked: None
) -> None:
    refused, fine, other = letter("t1"), letter("t2", args=[4, 2]), letter("t3", args=[6, 3])
    replayed = letter("t4", args=[8, 4], replayed_at=timezone.now(), replayed_by="cli:x")
    chosen = [refused.pk, fine.pk, other.pk, replayed.pk]

    page = run_action(staff, DEAD_LETTERS, "replay_selected", chosen)

    text = page.content.decode()
    assert "Replay <strong>4</strong> dead letters:" in text
    assert "3 of them still wait; the others were replayed or resolved before" in text
    refusals = text[text.index('<ul id="refused">') :]
    assert f"#{refused.pk}</a> {DIVIDE}: {BY_ZERO}" in refusals.replace("&#x27;", "'")
    assert 'value="Replay the other 2"' in text
    assert 'value="Replay anyway: all 3"' in text
    assert not OperatorAction.objects.exists()  # nothing done yet

    done = submitted(staff, page, "confirm")

    assert messages(done) == [
        ("success", "Replayed 2 dead letter(s)."),
        (
            "warning",
            f"Not replayed, 1 refused by their check (correct what it names, or replay "
            f"anyway): #{refused.pk}: {BY_ZERO}",
        ),
        ("warning", "Skipped 1 already replayed."),
    ]
    assert set(DeadLetter.objects.filter(replayed_by="admin:op").values_list("pk", flat=True)) == {
        fine.pk,
        other.pk,
    }

    again = run_action(staff, DEAD_LETTERS, "replay_selected", [refused.pk])
    assert 'value="Replay the other' not in again.content.decode()  # nothing else to replay
    forced = submitted(staff, again, "force")
    assert messages(forced) == [
        ("success", "Replayed 1 dead letter(s)."),
        ("warning", f"Replayed by force, past their check: #{refused.pk}: {BY_ZERO}"),
    ]
    refused.refresh_from_db()
    assert refused.replayed_by == "admin:op"
    assert OperatorAction.objects.filter(
        target_id=str(refused.pk), detail__endswith=f"forced past its check, which said: {BY_ZERO}"
    ).exists()


def test_the_replay_button_of_a_refused_letter_asks_first_then_replays_anyway(
    staff: Client, checked: None
) -> None:
    refused = letter("t1")
    page_url = f"{DEAD_LETTERS}{refused.pk}/change/"
    replay_url = f"{DEAD_LETTERS}{refused.pk}/replay/"

    asked = staff.post(replay_url)

    assert asked.status_code == 200
    text = asked.content.decode()
    assert BY_ZERO in text.replace("&#x27;", "'")
    assert f'action="{replay_url}"' in text
    assert 'name="confirm"' not in text  # one letter, refused: only Replay anyway
    refused.refresh_from_db()
    assert refused.replayed_at is None

    forced = submitted(staff, asked, "force", url=replay_url)

    assert forced.redirect_chain == [(page_url, 302)]
    [(level, text)] = messages(forced)
    assert level == "warning"
    assert text == (
        f"Replayed dead letter {refused.pk} by force: its job is queued again, although its "
        f"check said: {BY_ZERO}"
    )
    refused.refresh_from_db()
    assert refused.replayed_by == "admin:op"


def test_resolve_and_unresolve_ask_first_with_the_count(staff: Client) -> None:
    first, second = letter("t1"), letter("t2")

    asked = run_action(staff, DEAD_LETTERS, "resolve_selected", [first.pk, second.pk])
    assert "Resolve <strong>2</strong> dead letters:" in asked.content.decode()
    page = asked.content.decode()
    resolved = staff.post(
        DEAD_LETTERS,
        {**form_data(asked, "confirmation-form"), "confirm": "1", "why": "a test"},
        follow=True,
    )
    assert messages(resolved) == [("success", "Resolved 2 dead letter(s).")]
    assert 'name="why"' in page

    asked = run_action(staff, DEAD_LETTERS, "unresolve_selected", [first.pk])
    text = asked.content.decode()
    assert "Unresolve <strong>1</strong> dead letter:" in text
    assert "it waits again" in text
    first.refresh_from_db()
    assert first.resolved_at is not None  # asked only

    undone = submitted(staff, asked, "confirm")

    assert messages(undone) == [("success", "1 dead letter(s) wait again.")]
    first.refresh_from_db()
    assert first.resolved_at is None


@pytest.fixture
def described() -> Iterator[None]:
    """The division's describer: what it computes, and what became of that (its app's words)."""

    @describer(divide)
    def divisions(letters: Sequence[DeadLetter]) -> dict[int, Subject]:
        return {
            letter.pk: Subject(
                kind="division",
                label=f"{letter.args[0]}/{letter.args[1]}",
                outcome="answered 2026-12-03 17:02 UTC" if letter.args[1] else "",
            )
            for letter in letters
        }

    yield
    deadletters._describers.pop(DIVIDE)


def replayed(task_id: str, *, args: list[Any], **job: Any) -> DeadLetter:
    """A dead letter replayed from this test: its replay's job, as the machinery left it."""
    made = Job.objects.create(task=DIVIDE, args=args, queue="default", **job)
    return letter(task_id, args=args, replayed_at=timezone.now(), replayed_by="x", replay_job=made)


def test_what_became_of_a_replay_is_shown_on_the_list_and_the_page(
    staff: Client, described: None
) -> None:
    now = timezone.now()
    waiting = letter("t1", args=[1, 0])
    pending = replayed("t2", args=[1, 0])
    answered = replayed("t3", args=[6, 3], status=Job.Status.SUCCESSFUL, finished_at=now)
    failed = replayed("t4", args=[1, 0], published_at=now, status=Job.Status.FAILED)
    assert failed.replay_job_id is not None
    again = letter(message_id(failed.replay_job_id), args=[1, 0])

    listed = {row["id"]: row for row in rows(staff.get(DEAD_LETTERS))}

    assert listed[str(waiting.pk)]["outcome"] == "-"
    assert listed[str(pending.pk)]["outcome"] == (f"job {pending.replay_job_id} not yet published")
    assert listed[str(answered.pk)]["outcome"].startswith(
        f"job {answered.replay_job_id} succeeded "
    )
    assert listed[str(answered.pk)]["outcome"].endswith(
        " UTC; division: answered 2026-12-03 17:02 UTC"
    )
    assert listed[str(failed.pk)]["outcome"] == f"dead-lettered again as dead letter #{again.pk}"
    page = staff.get(f"{DEAD_LETTERS}{failed.pk}/change/").content.decode()
    assert f'<a href="{DEAD_LETTERS}{again.pk}/change/">dead letter #{again.pk}</a>' in page
    page = staff.get(f"{DEAD_LETTERS}{answered.pk}/change/").content.decode()
    assert "division: answered 2026-12-03 17:02 UTC" in page


def test_the_outcome_column_costs_the_same_queries_however_many_replays(
    staff: Client, described: None
) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            listed = rows(staff.get(DEAD_LETTERS))
        assert all(row["outcome"] != "-" for row in listed)
        return len(captured)

    def failed_replay(n: int) -> None:
        failed = replayed(f"r{n}", args=[n, 1], status=Job.Status.FAILED)
        assert failed.replay_job_id is not None
        # Dead-lettered again, and that one replayed too: still waiting to be published.
        again = letter(message_id(failed.replay_job_id), args=[n, 1])
        made = Job.objects.create(task=DIVIDE, args=[n, 1], queue="default")
        DeadLetter.objects.filter(pk=again.pk).update(replayed_at=timezone.now(), replay_job=made)

    failed_replay(1)
    queries()  # the first request also reads the user's permissions
    one = queries()
    for n in range(2, 25):
        failed_replay(n)
    assert queries() == one


# The command line, as an operator runs it


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--reason", "lost"], "--reason: 'lost' is not one of permanent, exhausted"),
        (["1", "--task", DIVIDE], "give dead letter IDs or --task, not both"),
        (["--since", "2026-12-03", "--until", "2026-12-01"], "--until: must be later than since"),
        (["--until", "9999-12-31"], "--until: '9999-12-31' is out of range: its end is past"),
    ],
)
def test_dlq_bad_filters_exit_non_zero_with_the_reason(args: list[str], error: str) -> None:
    waiting = letter("t1")
    done = python("manage.py", "dlq", "replay", *args)
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = done.stderr.splitlines()  # one line
    assert error in line
    assert done.stdout == ""
    waiting.refresh_from_db()
    assert waiting.replayed_at is None


def test_an_until_past_the_last_day_is_a_400_with_the_reason() -> None:
    """The end of 9999-12-31 is no date: a viewer's dry run says so, as any other bad filter."""
    viewer = api_as(staff_user("watcher", groups=["viewers"]))
    far = bulk(viewer, {"action": "replay", "until": "9999-12-31", "dry_run": True}, key=None)
    assert (far.status_code, far.json()) == (
        400,
        {
            "until": [
                "'9999-12-31' is out of range: its end is past the year 9999 (leave until out "
                "for no end)"
            ]
        },
    )
    # Its start is a date: nothing was made then.
    since = bulk(viewer, {"action": "replay", "since": "9999-12-31", "dry_run": True}, key=None)
    assert (since.status_code, since.json()["selected"]) == (200, 0)


# Bounded: at most BULK_LIMIT a request, a statement timeout, and the command beyond


def waiting_letters(count: int, **fields: Any) -> list[int]:
    """``count`` dead letters waiting, made at once; their ids in order."""
    now = timezone.now()
    made = DeadLetter.objects.bulk_create(
        DeadLetter(
            **{
                "task": DIVIDE,
                "task_id": f"outage-{n}",
                "args": [n, 1],
                "queue": "default",
                "reason": "provider_unavailable",
                "exception_class": "asyncwork.errors.ProviderUnavailable",
                "exception_message": "email provider unavailable: its breaker stayed open",
                "attempts": 1,
                "first_failed_at": now,
                "last_failed_at": now,
                **fields,
            }
        )
        for n in range(count)
    )
    return [x.pk for x in made]


def test_a_bulk_request_past_the_limit_is_a_413_naming_the_command(operator: APIClient) -> None:
    ids = waiting_letters(BULK_LIMIT + 1)
    viewer = api_as(staff_user("watcher", groups=["viewers"]))

    by_filter = bulk(operator, {"action": "replay", "reason": "provider_unavailable"})
    looked = bulk(viewer, {"action": "replay", "all": True, "dry_run": True}, key=None)
    by_ids = bulk(operator, {"action": "resolve", "ids": ids, "why": "paid by cheque"}, key="b")

    command = "manage.py dlq replay --reason provider_unavailable"
    assert (by_filter.status_code, by_filter.json()) == (
        413,
        {
            "detail": f"{BULK_LIMIT + 1} dead letters selected: a request acts on at most "
            f"{BULK_LIMIT}. Choose fewer (ids, or narrower reason, task, since, until), or run "
            f"the command, which takes any number a batch at a time: {command}",
            "selected": BULK_LIMIT + 1,
            "limit": BULK_LIMIT,
            "command": command,
        },
    )
    assert (looked.status_code, looked.json()["command"]) == (
        413,
        "manage.py dlq replay --all --dry-run",
    )
    assert (by_ids.status_code, by_ids.json()["command"]) == (
        413,
        "manage.py dlq resolve ID [ID ...] --why 'paid by cheque'",
    )
    assert selection().count() == BULK_LIMIT + 1  # nothing done
    assert not IdempotencyRecord.objects.exists()  # the keys are unused
    assert not OperatorAction.objects.exists()

    # At the limit: done, in one request.
    done = bulk(operator, {"action": "replay", "ids": ids[:BULK_LIMIT]}, key="c")
    assert (done.status_code, len(done.json()["replayed"])) == (200, BULK_LIMIT)
    assert list(selection().values_list("pk", flat=True)) == ids[BULK_LIMIT:]


def test_the_admins_select_all_past_the_limit_is_refused_with_the_command(staff: Client) -> None:
    waiting_letters(BULK_LIMIT + 1)
    for action in ("replay_selected", "resolve_selected", "unresolve_selected"):
        answer = staff.post(
            DEAD_LETTERS,
            {"action": action, "select_across": "1", "index": "0", "_selected_action": ["1"]},
            follow=True,
        )
        [(level, text)] = messages(answer)
        assert level == "error"
        assert text.startswith(
            f"Nothing done: {BULK_LIMIT + 1} dead letters selected, and the admin acts on at "
            f"most {BULK_LIMIT} at once. Narrow the list with its filters, or from a terminal, "
            "for any number a batch at a time: manage.py dlq "
        ), text
    assert selection().count() == BULK_LIMIT + 1
    assert not OperatorAction.objects.exists()


@contextmanager
def row_locked(pk: int) -> Iterator[None]:
    """Dead letter ``pk`` locked FOR UPDATE by another transaction (another session's replay,
    say) for the block."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                DeadLetter.objects.select_for_update().get(pk=pk)
                locked.set()
                release.wait(60)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        yield
    finally:
        release.set()
        holder.join(10)


@pytest.mark.django_db(transaction=True)
def test_a_bulk_statement_that_waits_too_long_is_a_503_and_does_nothing(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "BULK_STATEMENT_TIMEOUT_SECONDS": 0.5}
    [held] = waiting_letters(1)
    operator = api_as(staff_user("op", groups=["operators"]))
    staff = admin_as(staff_user("op2", groups=["operators"]))

    with row_locked(held):
        started = time.monotonic()
        answer = bulk(operator, {"action": "replay", "ids": [held]}, key="k")
        waited = time.monotonic() - started
        page = staff.post(
            DEAD_LETTERS,
            {"action": "replay_selected", "_selected_action": [held], "confirm": "1"},
            follow=True,
        )

    assert (answer.status_code, answer.json(), answer["Retry-After"]) == (
        503,
        {
            "detail": "a database statement took longer than 0.5 s (dead letters another action "
            "holds, or a slow database); nothing was done: try again"
        },
        "1",
    )
    assert waited < 5
    assert messages(page) == [
        (
            "error",
            "Nothing done: a database statement took longer than 0.5 s (dead letters another "
            "action holds, or a slow database). Try again.",
        )
    ]
    assert selection().count() == 1
    assert not IdempotencyRecord.objects.exists()
    assert not OperatorAction.objects.exists()
    # Retried under its key once the rows are free: done, once.
    again = bulk(operator, {"action": "replay", "ids": [held]}, key="k")
    assert (again.status_code, again.json()["replayed"]) == (200, [held])
    assert bulk(operator, {"action": "replay", "ids": [held]}, key="k")["Idempotent-Replayed"]
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_command_commits_a_batch_at_a_time_and_a_run_cut_short_goes_on() -> None:
    """A receiver of the operator actions that fails on the 700th letter stops the run in its
    second batch: the first stays replayed, the second is rolled back; run again, the command
    replays the rest, and none twice."""
    ids = waiting_letters(BATCH * 2 + 200)
    seen: list[int] = []

    def fail_at_700(*, target: DeadLetter, **_: Any) -> None:
        seen.append(target.pk)
        if len(seen) == 700:
            raise RuntimeError("the audit trail's disk is full")

    operator_acted.connect(fail_at_700, dispatch_uid="test.fail_at_700")
    try:
        with pytest.raises(RuntimeError, match="disk is full"):
            call_command("dlq", "replay", "--all", "--actor", "op", stdout=StringIO())
    finally:
        operator_acted.disconnect(dispatch_uid="test.fail_at_700")
    replayed = DeadLetter.objects.filter(replayed_at__isnull=False).order_by("pk")
    assert list(replayed.values_list("pk", flat=True)) == ids[:BATCH]
    assert OperatorAction.objects.count() == Job.objects.count() == BATCH

    out = StringIO()
    call_command("dlq", "replay", "--all", "--actor", "op", stdout=out)

    assert out.getvalue().splitlines()[-1] == f"{len(ids) - BATCH} replayed, 0 skipped"
    assert not selection().exists()
    assert Job.objects.count() == len(ids)
    assert DeadLetter.objects.values("replay_job").distinct().count() == len(ids)
    assert OperatorAction.objects.filter(detail__startswith="replayed: ").count() == len(ids)


@pytest.mark.slow  # a measurement: what the bounds above cost
@pytest.mark.django_db(transaction=True)  # each commit publishes its jobs, as in production
def test_what_a_replay_costs_a_letter_at_the_limit_and_in_the_commands_batches(
    operator: APIClient,
) -> None:
    """Three statements a letter (its job, its operator action, its publish's mark),
    whether a request replays BULK_LIMIT or the command three batches; a request refused for
    its size costs a few, however many it chose."""
    ids = waiting_letters(BULK_LIMIT + BATCH * 3)
    with CaptureQueriesContext(connection) as refused:
        too_many = bulk(operator, {"action": "replay", "all": True}, key="all")
    assert too_many.status_code == 413
    with CaptureQueriesContext(connection) as api:
        answer = bulk(operator, {"action": "replay", "ids": ids[:BULK_LIMIT]})
    assert len(answer.json()["replayed"]) == BULK_LIMIT
    with CaptureQueriesContext(connection) as command:
        call_command("dlq", "replay", "--all", "--actor", "op", stdout=StringIO())
    assert not selection().exists()
    print(
        f"\nqueries: API refusing {len(ids)}: {len(refused)}; API replaying {BULK_LIMIT}: "
        f"{len(api)}; command replaying {BATCH * 3}: {len(command)}"
    )
    assert len(refused) <= 15  # the user and their permissions, the selection cut at the limit
    assert len(api) <= 3 * BULK_LIMIT + 20
    assert len(command) <= 3 * BATCH * 3 + 3 * 10


OUTAGE = 20_000


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_20000_after_an_outage_through_gunicorn_and_the_command_each_replayed_once(
    tmp_path: Path,
) -> None:
    """The recovery after a provider outage, on PostgreSQL, through a real gunicorn (its 30 s
    timeout) and the real command: the API refuses the whole selection at once with the command
    to run, replays BULK_LIMIT of them in one request (retried: answered again, nothing more),
    and the command replays the rest in committed batches; every letter is replayed once."""
    ids = waiting_letters(OUTAGE)
    staff_user("op", groups=["operators"])
    token = api_token_create(username="op", actor="cli:test").token
    config = launch.GunicornConfig(workers=2, timeout=30)
    log = tmp_path / "gunicorn.log"
    with launch.gunicorn(worker_env(0), config=config, log=log) as server:

        def post(body: dict[str, Any], key: str | None = None) -> tuple[requests.Response, float]:
            headers = {"Authorization": f"Token {token}"}
            if key is not None:
                headers["Idempotency-Key"] = key
            started = time.monotonic()
            answer = requests.post(
                f"http://{HOST}:{server.port}{BULK}", json=body, headers=headers, timeout=60
            )
            return answer, time.monotonic() - started

        far, _ = post({"action": "replay", "until": "9999-12-31", "dry_run": True})
        whole, whole_s = post({"action": "replay", "reason": "provider_unavailable"}, key="all")
        looked, looked_s = post({"action": "replay", "all": True, "dry_run": True})
        part, part_s = post({"action": "replay", "ids": ids[:BULK_LIMIT]}, key="first")
        retried, _ = post({"action": "replay", "ids": ids[:BULK_LIMIT]}, key="first")
    assert far.status_code == 400
    assert far.json()["until"][0].startswith("'9999-12-31' is out of range")
    assert (whole.status_code, whole.json()["selected"], whole.json()["command"]) == (
        413,
        OUTAGE,
        "manage.py dlq replay --reason provider_unavailable",
    )
    assert (looked.status_code, looked.json()["selected"]) == (413, OUTAGE)
    assert (part.status_code, part.json()["replayed"]) == (200, ids[:BULK_LIMIT])
    assert (retried.json(), retried.headers["Idempotent-Replayed"]) == (part.json(), "true")
    assert "WORKER TIMEOUT" not in log.read_text()

    started = time.monotonic()
    argv = ["manage.py", "dlq", "replay", "--reason", "provider_unavailable", "--actor", "ops"]
    command = python(*argv, timeout=600)
    command_s = time.monotonic() - started
    assert command.returncode == 0, command.stderr[-2000:]
    assert command.stdout.splitlines()[-1] == f"{OUTAGE - BULK_LIMIT} replayed, 0 skipped"

    assert not selection().exists()
    assert Job.objects.count() == OUTAGE
    assert DeadLetter.objects.values("replay_job").distinct().count() == OUTAGE
    by = dict(DeadLetter.objects.values_list("replayed_by").annotate(n=Count("pk")).order_by())
    assert by == {"api:op": BULK_LIMIT, "cli:ops": OUTAGE - BULK_LIMIT}
    assert OperatorAction.objects.filter(detail__startswith="replayed: ").count() == OUTAGE
    print(
        f"\n{OUTAGE} waiting: API whole selection 413 in {whole_s:.2f} s, its dry run 413 in "
        f"{looked_s:.2f} s; API {BULK_LIMIT} replayed in {part_s:.2f} s; command "
        f"{OUTAGE - BULK_LIMIT} replayed in {command_s:.1f} s"
    )
