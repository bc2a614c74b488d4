"""What an application's own admin builds on, as the machinery's does: ``ReadOnlyAdmin`` for rows
that record what happened, ``has_power`` for an action's permission, ``admin_actor`` for the
actor an action records. Registers nothing."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest


def has_power(request: HttpRequest, model: type[Model], codename: str) -> bool:
    """Whether the user holds ``codename``, a permission ``model`` declares in its Meta."""
    return request.user.has_perm(f"{model._meta.app_label}.{codename}")


def admin_actor(request: HttpRequest) -> str:
    return f"admin:{request.user.get_username()}"


class ReadOnly:
    """Nothing added, changed or deleted through the admin: only the acting services write."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(ReadOnly, admin.ModelAdmin):
    """Without the change permission Django shows every field of the page read-only, so
    ``readonly_fields`` need not list them."""
