"""Dead letters over the API: reading needs the view permission and replaying the replay
permission too, and a replay is recorded as an operator action; the OpenAPI schema
(schemathesis against it: ``test_api_fuzz``)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from asyncwork.contrib.operators.models import OperatorAction
from tests.helpers.admin import api_as
from tests.helpers.deadletters import dead_letter as letter
from tests.helpers.factories import paid_invoice, staff_user

pytestmark = pytest.mark.django_db


def test_dead_letters_list_filter_and_replay_once(api_staff: APIClient) -> None:
    first = letter("t1")
    letter("t2", reason="exhausted")
    assert api_staff.get("/api/dead-letters/").json()["count"] == 2
    rows = api_staff.get("/api/dead-letters/?reason=exhausted").json()["results"]
    assert [row["task_id"] for row in rows] == ["t2"]

    replay = api_staff.post(f"/api/dead-letters/{first.pk}/replay/")
    assert replay.status_code == 200
    assert replay.json() == {"id": first.pk, "replayed": True, "detail": "replayed"}
    again = api_staff.post(f"/api/dead-letters/{first.pk}/replay/").json()
    assert again["replayed"] is False
    first.refresh_from_db()
    assert first.replayed_by == "api:op"
    recorded = list(OperatorAction.objects.order_by("pk"))
    assert [(a.action, a.actor, a.target, a.detail.split(":")[0]) for a in recorded] == [
        ("dead_letter.replay", "api:op", first, "replayed"),
        ("dead_letter.replay", "api:op", first, "skipped"),
    ]
    waiting = api_staff.get("/api/dead-letters/?replayed=false").json()["results"]
    assert [row["task_id"] for row in waiting] == ["t2"]


def test_a_viewer_reads_and_gets_403_on_replay() -> None:
    waiting = letter("t1")
    viewer = api_as(staff_user("watcher", groups=["viewers"]))

    assert viewer.get("/api/dead-letters/").json()["count"] == 1
    assert viewer.get(f"/api/dead-letters/{waiting.pk}/").status_code == 200
    refused = viewer.post(f"/api/dead-letters/{waiting.pk}/replay/")

    assert refused.status_code == 403
    assert "permission" in refused.json()["detail"]
    waiting.refresh_from_db()
    assert (waiting.replayed_at, waiting.replay_job) == (None, None)
    assert not OperatorAction.objects.exists()


def test_each_dead_letter_says_what_it_was_about_and_why_in_words(api_staff: APIClient) -> None:
    invoice = paid_invoice(number="INV-77", customer_email="typo@exmaple.com")
    refused = letter(
        "t1",
        args=[invoice.pk],
        exception_message="recipient refused: 550 5.1.1 no such user\n(typo@exmaple.com)",
    )
    unknown = letter("t2", task="core.gone", args=[3], exception_message="it broke")

    listed = {row["id"]: row for row in api_staff.get("/api/dead-letters/").json()["results"]}
    one = api_staff.get(f"/api/dead-letters/{refused.pk}/").json()

    expected = {
        "kind": "invoice",
        "label": "INV-77",
        "recipient": "typo@exmaple.com",
        "url": f"/admin/invoicing/invoice/{invoice.pk}/change/",
    }
    failure = "recipient refused: 550 5.1.1 no such user (typo@exmaple.com)"
    # What became of the work, in the invoicing app's words.
    outcome = listed[refused.pk]["subject"].pop("outcome")
    assert outcome
    assert one["subject"].pop("outcome") == outcome
    assert (listed[refused.pk]["subject"], listed[refused.pk]["failure"]) == (expected, failure)
    assert (one["subject"], one["failure"]) == (expected, failure)
    assert one["exception_message"] == refused.exception_message  # as stored
    assert (listed[unknown.pk]["subject"], listed[unknown.pk]["failure"]) == (None, "it broke")


def test_a_page_of_dead_letters_costs_the_same_queries_whatever_its_size(
    api_staff: APIClient,
) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            response = api_staff.get("/api/dead-letters/")
        assert response.status_code == 200
        assert all(row["subject"] for row in response.json()["results"])
        return len(captured)

    letter("t0", args=[paid_invoice().pk])
    queries()  # the first request also reads the user's permissions
    one = queries()
    for n in range(1, 30):
        letter(f"t{n}", args=[paid_invoice().pk])
    assert queries() == one


def test_the_schema_describes_subject_and_failure(api_staff: APIClient) -> None:
    components = api_staff.get("/api/schema/?format=json").json()["components"]["schemas"]
    properties = components["DeadLetter"]["properties"]
    assert properties["failure"]["type"] == "string"
    assert set(components["Subject"]["properties"]) == {
        "kind",
        "label",
        "recipient",
        "url",
        "outcome",
    }
    assert {"subject", "failure"} <= set(components["DeadLetter"]["required"])


@pytest.mark.parametrize(
    ("perms", "read", "replay"),
    [
        ([], 403, 403),  # staff alone reads nothing: DRF's model permissions would let it
        (["asyncwork.replay_deadletter"], 403, 403),  # a power without the view
        (["asyncwork.view_deadletter"], 200, 403),
        (["asyncwork.view_deadletter", "asyncwork.replay_deadletter"], 200, 200),
    ],
)
def test_each_permission_opens_exactly_its_part(perms: list[str], read: int, replay: int) -> None:
    waiting = letter("t1")
    client = api_as(staff_user("someone", perms=perms))

    assert client.get("/api/dead-letters/").status_code == read
    assert client.get(f"/api/dead-letters/{waiting.pk}/").status_code == read
    assert client.post(f"/api/dead-letters/{waiting.pk}/replay/").status_code == replay

    waiting.refresh_from_db()
    assert (waiting.replayed_at is not None) == (replay == 200)
    assert OperatorAction.objects.count() == (1 if replay == 200 else 0)


@pytest.mark.parametrize(
    ("perms", "resolve"),
    [
        (["asyncwork.view_deadletter"], 403),
        (["asyncwork.view_deadletter", "asyncwork.replay_deadletter"], 403),
        (["asyncwork.view_deadletter", "asyncwork.resolve_deadletter"], 200),
    ],
)
def test_resolving_needs_its_own_power(perms: list[str], resolve: int) -> None:
    waiting = letter("t1")
    client = api_as(staff_user("someone", perms=perms))
    answer = client.post(f"/api/dead-letters/{waiting.pk}/resolve/", {"why": "refunded"})
    assert answer.status_code == resolve
    waiting.refresh_from_db()
    assert (waiting.resolved_at is not None) == (resolve == 200)


def test_a_resolved_letter_says_why_is_filtered_apart_and_is_not_replayed(
    api_staff: APIClient,
) -> None:
    dropped, other = letter("t1"), letter("t2")
    assert api_staff.post(f"/api/dead-letters/{dropped.pk}/resolve/", {}).json() == {
        "why": "say why the job will not be run"
    }
    answer = api_staff.post(f"/api/dead-letters/{dropped.pk}/resolve/", {"why": "refunded"})
    assert answer.json() == {"id": dropped.pk, "changed": True, "detail": "resolved"}
    again = api_staff.post(f"/api/dead-letters/{dropped.pk}/resolve/", {"why": "refunded"})
    assert again.json()["changed"] is False

    shown = api_staff.get(f"/api/dead-letters/{dropped.pk}/").json()
    assert (shown["resolved_by"], shown["resolved_why"]) == ("api:op", "refunded")
    listed = api_staff.get("/api/dead-letters/?resolved=false").json()["results"]
    assert [row["id"] for row in listed] == [other.pk]
    assert api_staff.get("/api/dead-letters/?resolved=maybe").status_code == 400

    replay = api_staff.post(f"/api/dead-letters/{dropped.pk}/replay/").json()
    assert replay == {
        "id": dropped.pk,
        "replayed": False,
        "detail": "resolved; unresolve it to replay it",
    }
    undone = api_staff.post(f"/api/dead-letters/{dropped.pk}/unresolve/").json()
    assert undone == {"id": dropped.pk, "changed": True, "detail": "waits again"}
    assert api_staff.post(f"/api/dead-letters/{dropped.pk}/replay/").json()["replayed"] is True


def test_no_staff_no_api_whatever_the_permissions() -> None:
    waiting = letter("t1")
    assert APIClient().get("/api/dead-letters/").status_code in (401, 403)
    assert APIClient().post(f"/api/dead-letters/{waiting.pk}/replay/").status_code in (401, 403)
    customer = api_as(staff_user("customer", groups=["operators"], is_staff=False))
    assert customer.get("/api/dead-letters/").status_code == 403
    assert customer.post(f"/api/dead-letters/{waiting.pk}/replay/").status_code == 403
    waiting.refresh_from_db()
    assert waiting.replayed_at is None


def test_bad_filters_and_unknown_ids(api_staff: APIClient) -> None:
    assert api_staff.get("/api/dead-letters/?reason=nope").status_code == 400
    assert api_staff.get("/api/dead-letters/?replayed=maybe").status_code == 400
    assert api_staff.post("/api/dead-letters/424242/replay/").status_code == 404
    assert api_staff.get("/api/dead-letters/1/replay/").status_code == 405


def test_schema_is_served_to_staff_and_valid(api_staff: APIClient) -> None:
    response = api_staff.get("/api/schema/?format=json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {
        "/api/invoices/",
        "/api/invoices/{id}/",
        "/api/dead-letters/",
        "/api/dead-letters/{id}/replay/",
    } <= set(paths)
    assert APIClient().get("/api/schema/").status_code in (401, 403)
