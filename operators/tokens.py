"""API tokens (django-rest-knox): issued to a named user, stored only as a digest, expiring.

The token is shown once, when issued; the database keeps its SHA-512 digest and the first
15 characters (knox's lookup prefix), so a copy of the database authenticates nobody. Each
token expires ``API_TOKEN_TTL_HOURS`` after it is issued (knox deletes it at its first use
after that, and the API answers 401). Tokens are issued from the command line
(``manage.py api_token create USERNAME``), by someone who can already run commands on the
deployment: no HTTP endpoint trades a password for a token, so there is no second password
form to guess at beside the admin's, which django-axes limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme
from knox.auth import TokenAuthentication
from knox.models import AuthToken
from rest_framework.exceptions import AuthenticationFailed


class ApiTokenAuthentication(TokenAuthentication):
    """knox's token authentication, except that a token that is not printable ASCII is a 401
    before it reaches knox: knox decodes the header's bytes as UTF-8 unguarded, so
    ``Authorization: Token \\xe9`` was a 500 (DRF's own TokenAuthentication catches it), and a
    NUL reached PostgreSQL, which refuses it in text (another 500). A real token is
    hexadecimal."""

    def authenticate_credentials(self, token: bytes) -> tuple[AbstractBaseUser, AuthToken]:
        if not all(0x21 <= byte <= 0x7E for byte in token):
            raise AuthenticationFailed("Invalid token.")
        user, auth_token = super().authenticate_credentials(token)
        return user, auth_token


class ApiTokenScheme(KnoxTokenScheme):
    """The OpenAPI schema's security scheme for it: knox's (``Authorization: Token ...``)."""

    target_class = "operators.tokens.ApiTokenAuthentication"


class TokenRefused(ValueError):
    """The user cannot be given a token (unknown or inactive), or the lifetime is invalid."""


@dataclass(frozen=True)
class IssuedToken:
    token: str  # the only copy: it is not stored
    expiry: datetime
    user: AbstractBaseUser


def _user(username: str) -> AbstractBaseUser:
    model = get_user_model()
    user = model._default_manager.filter(**{model.USERNAME_FIELD: username}).first()
    if user is None:
        raise TokenRefused(f"no user named {username!r}")
    if not user.is_active:
        raise TokenRefused(f"user {username!r} is inactive")
    return user


def api_token_create(*, username: str, ttl: timedelta | None = None) -> IssuedToken:
    """Issue a token for ``username`` that expires after ``ttl`` (``API_TOKEN_TTL_HOURS`` by
    default). Raises ``TokenRefused`` for an unknown or inactive user or a lifetime not above
    zero."""
    ttl = ttl if ttl is not None else timedelta(hours=settings.API_TOKEN_TTL_HOURS)
    if ttl <= timedelta(0):
        raise TokenRefused("a token's lifetime must be above zero")
    user = _user(username)
    instance, token = AuthToken.objects.create(user=user, expiry=ttl)
    assert instance.expiry is not None  # given a ttl, knox always sets one
    return IssuedToken(token=token, expiry=instance.expiry, user=user)


def api_token_revoke(*, username: str) -> int:
    """Delete every token of ``username``; returns how many. Raises ``TokenRefused`` for an
    unknown user (an inactive one's tokens are deleted too)."""
    model = get_user_model()
    user = model._default_manager.filter(**{model.USERNAME_FIELD: username}).first()
    if user is None:
        raise TokenRefused(f"no user named {username!r}")
    deleted, _ = AuthToken.objects.filter(user=user).delete()
    return deleted
