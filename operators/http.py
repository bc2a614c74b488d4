"""Who is asking: the client address every per-client decision uses, and the username a login
attempt names.

One rule for the whole application (the webhook throttle, the ``/metrics`` allow-list and the
admin login limit): the socket's address, or, behind ``NUM_PROXIES`` trusted proxies, the
``NUM_PROXIES``-th entry from the right of ``X-Forwarded-For`` (DRF's ``get_ident``). The left
of that header is whatever the client wrote, so it never counts.
"""

from __future__ import annotations

import ipaddress
from typing import Any, cast

from django.contrib.auth import get_user_model
from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle


def _valid(value: str | None) -> str | None:
    try:
        return str(ipaddress.ip_address((value or "").strip()))
    except ValueError:
        return None


def client_address(request: HttpRequest) -> str | None:
    """The client's IP address, or None when neither the trusted hop nor the socket gives one.

    An entry that is not an address (a client reaching the app around its proxy can write any
    ``X-Forwarded-For``) falls back to the socket's address: a stored address is always one
    PostgreSQL accepts, and a forged header never files attempts under someone else's."""
    # DRF's get_ident reads only request.META, which a plain HttpRequest has.
    ident = BaseThrottle().get_ident(cast(Request, request))
    return _valid(ident) or _valid(request.META.get("REMOTE_ADDR"))


def login_username(request: HttpRequest, credentials: dict[str, Any] | None = None) -> str | None:
    """The username a login attempt names, as django-axes files it (``AXES_USERNAME_CALLABLE``):
    axes' own rule, cut to its 255-character column and without NUL. Django's login form does
    not bound the username it authenticates, so a scanner's longer one reached PostgreSQL and
    was a 500."""
    field = get_user_model().USERNAME_FIELD
    source = credentials if credentials else getattr(request, "data", request.POST)
    username = source.get(field)
    if username is None:
        return None
    return str(username).replace("\x00", "")[:255]
