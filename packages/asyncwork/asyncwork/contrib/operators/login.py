"""Who a login attempt names, for django-axes' per-username limit."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.http import HttpRequest


def login_username(request: HttpRequest, credentials: dict[str, Any] | None = None) -> str | None:
    """``AXES_USERNAME_CALLABLE``: axes' own rule, without NUL and cut to its 255-character
    column, as Django's login form does not bound it."""
    field = get_user_model().USERNAME_FIELD
    source = credentials if credentials else getattr(request, "data", request.POST)
    username = source.get(field)
    if username is None:
        return None
    return str(username).replace("\x00", "")[:255]
