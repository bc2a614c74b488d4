"""Idempotency keys (``asyncwork.contrib.idempotency``) on PostgreSQL: one run per (user, key)
however many
callers race, a different request under a used key refused, keys scoped to their user."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.db import connections
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from asyncwork.contrib.idempotency import (
    IdempotencyKeyReused,
    idempotency_key_from,
    idempotent_perform,
    idempotent_respond,
    request_fingerprint,
)
from asyncwork.models import IdempotencyRecord, Job
from invoicing.tasks import EMAIL_QUEUE
from stack.net import wait_until
from tests.helpers.database import lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)  # threads use their own connections


def make(tag: str) -> Callable[[], Job]:
    """Work that leaves a row behind: what a request under a key creates."""

    def perform() -> Job:
        return Job.objects.create(task="test.idempotency", args=[tag], queue=EMAIL_QUEUE)

    return perform


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user("alice")


@pytest.fixture
def bob() -> Any:
    return get_user_model().objects.create_user("bob")


def test_the_same_request_again_is_not_performed_again(alice: Any) -> None:
    first = idempotent_perform(
        user=alice, key="k1", fingerprint="f" * 64, request="POST /x/1/", perform=make("a")
    )
    again = idempotent_perform(
        user=alice, key="k1", fingerprint="f" * 64, request="POST /x/1/", perform=make("b")
    )

    assert first.replayed is False
    assert again.replayed is True
    assert first.result is not None
    assert again.result == first.result
    assert list(Job.objects.values_list("args", flat=True)) == [["a"]]
    record = IdempotencyRecord.objects.get()
    assert (record.key, record.target, record.request) == ("k1", first.result, "POST /x/1/")


def test_a_different_request_under_a_used_key_is_refused(alice: Any) -> None:
    idempotent_perform(
        user=alice, key="k1", fingerprint="1" * 64, request="POST /x/1/", perform=make("a")
    )
    with pytest.raises(
        IdempotencyKeyReused, match=r"already used for another request \(POST /x/1/\)"
    ):
        idempotent_perform(
            user=alice, key="k1", fingerprint="2" * 64, request="POST /x/2/", perform=make("b")
        )
    assert Job.objects.count() == 1


def test_an_answer_is_kept_and_given_again_when_the_work_is_not_one_row(alice: Any) -> None:
    """A bulk action's answer (lists of ids) is kept with the key: the same request again gets
    it, from the database, and does nothing; work that fails leaves the key unused."""
    done: list[str] = []

    def perform(tag: str) -> Callable[[], dict[str, Any]]:
        def work() -> dict[str, Any]:
            done.append(tag)
            return {"replayed": [1, 2], "refused": [{"id": 3, "detail": "why"}]}

        return work

    def failing() -> dict[str, Any]:
        raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError):
        idempotent_respond(
            user=alice, key="k1", fingerprint="f" * 64, request="POST /bulk/", perform=failing
        )
    assert not IdempotencyRecord.objects.exists()
    first = idempotent_respond(
        user=alice, key="k1", fingerprint="f" * 64, request="POST /bulk/", perform=perform("a")
    )
    again = idempotent_respond(
        user=alice, key="k1", fingerprint="f" * 64, request="POST /bulk/", perform=perform("b")
    )

    assert (first.replayed, again.replayed) == (False, True)
    assert again.response == first.response == perform("c")()
    assert done == ["a", "c"]
    assert IdempotencyRecord.objects.get().response == first.response
    with pytest.raises(IdempotencyKeyReused):
        idempotent_respond(
            user=alice, key="k1", fingerprint="0" * 64, request="POST /bulk/", perform=perform("d")
        )
    assert done == ["a", "c"]


def test_keys_are_scoped_to_their_user(alice: Any, bob: Any) -> None:
    a = idempotent_perform(
        user=alice, key="shared", fingerprint="1" * 64, request="r", perform=make("a")
    )
    b = idempotent_perform(
        user=bob, key="shared", fingerprint="2" * 64, request="r", perform=make("b")
    )

    assert (a.replayed, b.replayed) == (False, False)
    assert a.result != b.result
    assert Job.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 2


def test_work_that_fails_leaves_the_key_unused(alice: Any) -> None:
    def fail() -> Job:
        Job.objects.create(task="test.idempotency", args=["lost"], queue=EMAIL_QUEUE)
        raise ValueError("not now")

    with pytest.raises(ValueError, match="not now"):
        idempotent_perform(user=alice, key="k", fingerprint="1" * 64, request="r", perform=fail)
    assert not IdempotencyRecord.objects.exists()
    assert not Job.objects.exists()  # rolled back with the record

    later = idempotent_perform(
        user=alice, key="k", fingerprint="1" * 64, request="r", perform=make("ok")
    )
    assert later.replayed is False


def test_anonymous_callers_have_no_keys() -> None:
    with pytest.raises(TypeError):
        idempotent_perform(
            user=AnonymousUser(), key="k", fingerprint="1" * 64, request="r", perform=make("a")
        )


def test_racing_callers_perform_once(alice: Any) -> None:
    """Eight threads with one (user, key) at once. The first to insert is held inside its
    transaction (a lock on the jobs' table) until every other is waiting on PostgreSQL for
    its key: they provably overlap, and still the work runs once."""
    callers = 8
    outcomes: list[tuple[bool, int]] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            done = idempotent_perform(
                user=alice, key="race", fingerprint="1" * 64, request="r", perform=make("x")
            )
            assert done.result is not None
            outcomes.append((done.replayed, done.result.pk))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    holder = connections.create_connection("default")
    threads = [threading.Thread(target=call) for _ in range(callers)]
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"LOCK TABLE {Job._meta.db_table} IN SHARE MODE")
            for thread in threads:
                thread.start()
            # One waits on the table lock, the other seven on the first one's key.
            assert wait_until(lambda: lock_waiters() == callers, timeout=20)
            time.sleep(0.2)
            cursor.execute("COMMIT")
        for thread in threads:
            thread.join(30)
    finally:
        holder.close()

    assert errors == []
    assert len(outcomes) == callers
    assert sorted(replayed for replayed, _ in outcomes) == [False] + [True] * (callers - 1)
    assert len({pk for _, pk in outcomes}) == 1
    assert Job.objects.filter(task="test.idempotency").count() == 1
    assert IdempotencyRecord.objects.count() == 1


def test_a_racer_whose_first_rolls_back_does_the_work(alice: Any) -> None:
    """The first inserter fails after inserting its record; the one waiting on its key then
    inserts and performs (PostgreSQL's ON CONFLICT re-checks after the first's rollback)."""
    started = threading.Event()
    release = threading.Event()
    results: list[Any] = []

    def failing() -> Job:
        started.set()
        release.wait(20)
        raise ValueError("first fails")

    def first() -> None:
        try:
            idempotent_perform(
                user=alice, key="k", fingerprint="1" * 64, request="r", perform=failing
            )
        except ValueError as exc:
            results.append(str(exc))
        finally:
            connections.close_all()

    def second() -> None:
        try:
            done = idempotent_perform(
                user=alice, key="k", fingerprint="1" * 64, request="r", perform=make("second")
            )
            results.append(done.replayed)
        finally:
            connections.close_all()

    a = threading.Thread(target=first)
    a.start()
    assert started.wait(20)
    b = threading.Thread(target=second)
    b.start()
    time.sleep(0.5)  # b is now waiting on a's uncommitted key
    assert b.is_alive()
    release.set()
    a.join(30)
    b.join(30)

    assert sorted(map(str, results)) == ["False", "first fails"]
    assert list(Job.objects.values_list("args", flat=True)) == [["second"]]


def test_the_key_header_is_required_and_bounded() -> None:
    factory = APIRequestFactory()

    def key_of(**headers: str) -> str:
        return idempotency_key_from(Request(factory.post("/x/", **headers)))

    assert key_of(HTTP_IDEMPOTENCY_KEY="  ticket-1 ") == "ticket-1"
    assert key_of(HTTP_IDEMPOTENCY_KEY="clé-ünïcode") == "clé-ünïcode"
    for value in ("   ", "k" * 256, "a\x00b", "a\x1bb"):
        with pytest.raises(ValidationError) as raised:
            key_of(HTTP_IDEMPOTENCY_KEY=value)
        assert "Idempotency-Key" in str(raised.value.detail)
    with pytest.raises(ValidationError, match="this header is required"):
        key_of()


def test_the_fingerprint_tells_requests_apart() -> None:
    factory = APIRequestFactory()

    def fingerprint(path: str, body: Any = None, **params: Any) -> str:
        raw = factory.post(path, body, format="json") if body is not None else factory.post(path)
        return request_fingerprint(Request(raw, parsers=[JSONParser()]), **params)

    base = fingerprint("/api/invoices/1/resend-email/", invoice_id=1)
    assert base == fingerprint("/api/invoices/1/resend-email/", invoice_id=1)
    assert base != fingerprint("/api/invoices/2/resend-email/", invoice_id=2)
    assert base != fingerprint("/api/invoices/1/resend-email/", invoice_id=2)
    assert base != fingerprint("/api/invoices/1/resend-email/?x=1", invoice_id=1)
    with_body = fingerprint("/api/invoices/1/resend-email/", {"a": 1}, invoice_id=1)
    assert with_body != base
    assert with_body == fingerprint("/api/invoices/1/resend-email/", {"a": 1}, invoice_id=1)
    assert with_body != fingerprint("/api/invoices/1/resend-email/", {"a": 2}, invoice_id=1)
