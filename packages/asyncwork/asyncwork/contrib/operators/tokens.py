"""API tokens (django-rest-knox): issued to a named user, stored only as a digest, expiring.

The token is shown once; the database keeps its digest and lookup prefix, so a copy of it
authenticates nobody. Tokens are issued only from the command line (``manage.py api_token``):
no HTTP endpoint trades a password for one, so the admin's is the only password form. Issuing
and revoking are recorded as operator actions, never with the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme
from knox.auth import TokenAuthentication
from knox.models import AuthToken
from rest_framework.exceptions import AuthenticationFailed

from asyncwork.audit import operator_action_record
from asyncwork.settings import asyncwork_settings

# The operator actions' names (ruff's S105 reads any *_TOKEN_* name as a password).
ACTION_ISSUE = "api_token.issue"
ACTION_REVOKE = "api_token.revoke"


class ApiTokenAuthentication(TokenAuthentication):
    """knox's, except that a token that is not printable ASCII is a 401 before knox, which
    would decode it unguarded or pass a NUL to PostgreSQL (a 500 either way)."""

    def authenticate_credentials(self, token: bytes) -> tuple[AbstractBaseUser, AuthToken]:
        if not all(0x21 <= byte <= 0x7E for byte in token):
            raise AuthenticationFailed("Invalid token.")
        return super().authenticate_credentials(token)


class ApiTokenScheme(KnoxTokenScheme):
    """The OpenAPI schema's security scheme for it: knox's (``Authorization: Token ...``)."""

    target_class = "asyncwork.contrib.operators.tokens.ApiTokenAuthentication"


class TokenRefused(ValueError):
    """The user cannot be given a token (unknown or inactive), or the lifetime is invalid."""


@dataclass(frozen=True)
class IssuedToken:
    token: str  # the only copy: it is not stored
    expiry: datetime
    user: AbstractBaseUser


def _user(username: str, *, active: bool = True) -> AbstractBaseUser:
    model = get_user_model()
    user = model._default_manager.filter(**{model.USERNAME_FIELD: username}).first()
    if user is None:
        raise TokenRefused(f"no user named {username!r}")
    if active and not user.is_active:
        raise TokenRefused(f"user {username!r} is inactive")
    return user


def _token_state(token: AuthToken) -> dict[str, Any]:
    """What the audit trail keeps of a token: its lookup prefix and expiry."""
    expiry = token.expiry.isoformat() if token.expiry else None
    return {"token_key": token.token_key, "expiry": expiry}


def api_token_create(*, username: str, actor: str, ttl: timedelta | None = None) -> IssuedToken:
    """Issue a token expiring after ``ttl`` (default ``API_TOKEN_TTL_HOURS``), recorded as an
    operator action. Raises ``TokenRefused`` for an unknown or inactive user, or a lifetime not
    above zero or above ``API_TOKEN_MAX_HOURS``."""
    ttl = ttl if ttl is not None else timedelta(hours=asyncwork_settings.API_TOKEN_TTL_HOURS)
    if ttl <= timedelta(0):
        raise TokenRefused("a token's lifetime must be above zero")
    longest = timedelta(hours=asyncwork_settings.API_TOKEN_MAX_HOURS)
    if ttl > longest:
        raise TokenRefused(
            f"a token lives at most {asyncwork_settings.API_TOKEN_MAX_HOURS} hours "
            f"(API_TOKEN_MAX_HOURS); {ttl.total_seconds() / 3600:g} asked for"
        )
    user = _user(username)
    with transaction.atomic():
        instance, token = AuthToken.objects.create(user=user, expiry=ttl)
        assert instance.expiry is not None  # given a ttl, knox always sets one
        operator_action_record(
            action=ACTION_ISSUE,
            actor=actor,
            target=user,
            detail=f"token {instance.token_key}..., expires {instance.expiry:%Y-%m-%d %H:%M %Z}",
            after=_token_state(instance),
        )
    return IssuedToken(token=token, expiry=instance.expiry, user=user)


def api_token_revoke(*, username: str, actor: str) -> int:
    """Delete every token of ``username`` (inactive users' too); returns how many. Raises
    ``TokenRefused`` for an unknown user."""
    user = _user(username, active=False)
    return api_tokens_revoke(tokens=AuthToken.objects.filter(user=user), actor=actor)


def api_tokens_revoke(*, tokens: QuerySet[AuthToken], actor: str) -> int:
    """Delete ``tokens``, each recorded on its user as an operator action; returns how many."""
    with transaction.atomic():
        doomed = list(
            tokens.select_related("user").select_for_update(of=("self",)).order_by("created")
        )
        for token in doomed:
            operator_action_record(
                action=ACTION_REVOKE,
                actor=actor,
                target=token.user,
                detail=f"token {token.token_key}...",
                before=_token_state(token),
            )
        AuthToken.objects.filter(pk__in=[token.pk for token in doomed]).delete()
    return len(doomed)
