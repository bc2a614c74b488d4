"""``manage.py setup_groups``: "viewers" hold exactly the view permissions of the operators'
apps, "operators" those and the six powers; a second run changes nothing, and a group changed
by hand is set back."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.core.management.base import CommandError

pytestmark = pytest.mark.django_db

POWERS = {
    "asyncwork.replay_deadletter",
    "asyncwork.resolve_deadletter",
    "asyncwork.republish_job",
    "invoicing.resend_invoice_email",
    "invoicing.correct_invoice_recipient",
    "webhooks.reprocess_webhookevent",
}


def setup_groups() -> str:
    out = StringIO()
    call_command("setup_groups", stdout=out)
    return out.getvalue()


def perms(name: str) -> set[str]:
    return {
        f"{p.content_type.app_label}.{p.codename}"
        for p in Group.objects.get(name=name).permissions.select_related("content_type")
    }


def test_the_two_groups_hold_exactly_what_they_should() -> None:
    out = setup_groups()

    views = perms("viewers")
    assert {
        "asyncwork.view_deadletter",
        "asyncwork.view_job",
        "asyncwork.view_scheduledjob",
        "operators.view_operatoraction",
        "invoicing.view_invoice",
        "invoicing.view_emaildelivery",
        "webhooks.view_webhookevent",
        "django_celery_beat.view_periodictask",
    } <= views
    assert all(p.split(".")[1].startswith("view_") for p in views)
    assert not {p for p in views if p.split(".")[0] in {"auth", "authtoken", "admin"}}
    assert perms("operators") == views | POWERS
    assert out.splitlines() == [
        f"viewers: {len(views)} permissions (created; added {len(views)}, removed 0)",
        f"operators: {len(views) + len(POWERS)} permissions (created; "
        f"added {len(views) + len(POWERS)}, removed 0)",
    ]


def test_a_second_run_changes_nothing_and_a_hand_edit_is_set_back() -> None:
    setup_groups()
    before = {name: perms(name) for name in ("viewers", "operators")}
    ids = dict(Group.objects.values_list("name", "pk"))

    again = setup_groups()

    assert {name: perms(name) for name in ("viewers", "operators")} == before
    assert dict(Group.objects.values_list("name", "pk")) == ids
    assert [line.split("(")[1] for line in again.splitlines()] == ["unchanged)"] * 2

    viewers = Group.objects.get(name="viewers")
    viewers.permissions.add(Permission.objects.get(codename="replay_deadletter"))
    viewers.permissions.remove(Permission.objects.get(codename="view_invoice"))
    repaired = setup_groups()
    assert perms("viewers") == before["viewers"]
    assert repaired.splitlines()[0].endswith("(added 1, removed 1)")


def test_an_unknown_app_is_a_clear_error(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "OPERATOR_APPS": ["asyncwork", "nonesuch"]}
    with pytest.raises(CommandError, match=r"\['OPERATOR_APPS'\] names 'nonesuch', which is not"):
        setup_groups()
    assert not Group.objects.exists()
