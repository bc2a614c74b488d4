"""The project's message middleware (core/middleware.py): a request that never uses its
messages gets no message storage, and one that does keeps Django's behaviour (a message added
before a redirect is shown on the page it leads to)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import middleware as django_middleware
from django.http import HttpRequest

from asyncwork.models import Job
from core import middleware
from tests.helpers.admin import admin_as, messages, run_action
from tests.helpers.stripe import paid_event, post_event
from webhooks import testing as stripe_testing

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def storages_made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests whose message storage was made (Django's own, made as
    before), by this middleware or by Django's."""
    made: list[str] = []
    real = middleware.default_storage

    def default_storage(request: HttpRequest) -> Any:
        made.append(request.path)
        return real(request)

    monkeypatch.setattr(middleware, "default_storage", default_storage)
    monkeypatch.setattr(django_middleware, "default_storage", default_storage)
    return made


def test_a_request_that_never_uses_its_messages_makes_no_storage(
    client: Any, storages_made: list[str]
) -> None:
    response = post_event(client, stripe_testing.encode(paid_event()))
    assert response.status_code == 200
    assert storages_made == []
    assert "messages" not in response.cookies


def test_a_message_added_before_a_redirect_is_shown_after_it(storages_made: list[str]) -> None:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "x")
    # On a queue of the application's: the broker is emptied after every test.
    row = Job.objects.create(task="core.does_not_exist", args=[1], queue="email")
    shown = run_action(admin_as(user), "/admin/asyncwork/job/", "republish_selected", [row.pk])
    assert messages(shown) == [("success", "Published 1 job(s) again.")]
    # Made for the action's request (which added the message) and for the page showing it.
    assert storages_made.count("/admin/asyncwork/job/") == 2
