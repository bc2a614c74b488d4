"""Rows the tests need, built the way the application would have stored them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from io import StringIO
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command
from django.utils import timezone

from invoicing.models import Invoice

_numbers = itertools.count(1)


def paid_invoice(provider_id: str | None = None, **fields: Any) -> Invoice:
    """A paid invoice, as a webhook stores it; each call a new provider id, number and address
    unless given."""
    n = next(_numbers)
    provider_id = provider_id or f"in_test_{n}"
    values: dict[str, Any] = {
        "number": provider_id.upper(),
        "customer_email": f"{provider_id}@example.com",
        "amount_paid": 100,
        "currency": "usd",
        "status": "paid",
        "provider_updated_at": timezone.now(),
        **fields,
    }
    return Invoice.objects.create(provider_invoice_id=provider_id, **values)


def staff_user(
    username: str,
    *,
    groups: Iterable[str] = (),
    perms: Iterable[str] = (),
    password: str | None = None,
    is_staff: bool = True,
) -> Any:
    """A staff user who is not a superuser: in ``groups`` as ``manage.py setup_groups`` makes
    them ("operators", "viewers"), and holding ``perms`` ("app_label.codename")."""
    user = get_user_model().objects.create_user(username, password=password, is_staff=is_staff)
    groups = list(groups)
    if groups:
        call_command("setup_groups", stdout=StringIO())
        user.groups.add(*Group.objects.filter(name__in=groups))
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user
