"""Idempotency keys for API requests, Stripe's rules held by PostgreSQL: a request retried under its
key does its work once.

The ``IdempotencyRecord`` (UNIQUE per user and key) is inserted with ``ON CONFLICT DO NOTHING``
in the work's transaction, so failed work leaves the key unused, and a concurrent duplicate waits
for the first transaction (no check-then-insert window). The same request again gets what the
first created (``idempotent_perform``: a row) or the answer it got (``idempotent_respond``: a
JSON answer, a bulk action's); the same key with another request raises
``IdempotencyKeyReused`` (422). Keys are per user and do not expire.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.contrib.contenttypes.models import ContentType
from django.db import models, transaction
from django.http import QueryDict
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

from asyncwork.db import insert_or_skip
from asyncwork.models import IdempotencyRecord

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255

M = TypeVar("M", bound=models.Model)


class IdempotencyKeyReused(Exception):
    """The key was already used by this user for a different request."""


@dataclass(frozen=True)
class Performed(Generic[M]):
    # What the request created; None if deleted since, or not one row (a batch).
    result: M | None
    replayed: bool  # True: the key's request was made before; nothing was done now


def idempotency_key_from(request: Request) -> str:
    """The request's ``Idempotency-Key``; ``ValidationError`` (400) when missing, blank, over 255
    characters or holding control characters."""
    key = request.headers.get(HEADER, "").strip()
    if not key:
        raise ValidationError({HEADER: "this header is required"})
    if len(key) > MAX_KEY_LENGTH:
        raise ValidationError({HEADER: f"at most {MAX_KEY_LENGTH} characters"})
    if not key.isprintable():
        raise ValidationError({HEADER: "printable characters only"})
    return key


def request_fingerprint(request: Request, **params: Any) -> str:
    """SHA-256 of the method, path, query, parsed body and any ``params`` the view resolved."""
    body = request.data
    described = {
        "method": request.method,
        "path": request.path,
        "query": sorted(request.query_params.lists()),
        "body": sorted(body.lists()) if isinstance(body, QueryDict) else body,
        "params": params,
    }
    canonical = json.dumps(described, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _once(
    *,
    user: AbstractBaseUser | AnonymousUser,
    key: str,
    fingerprint: str,
    request: str,
    perform: Callable[[IdempotencyRecord], None],
) -> IdempotencyRecord | None:
    """Run ``perform`` with the new record once per (``user``, ``key``), in the transaction that
    inserts it. Returns None when it ran now, else the earlier request's record; raises
    ``IdempotencyKeyReused`` when that was another request."""
    if user.pk is None:
        raise TypeError("an idempotency key belongs to a signed-in user")
    record = IdempotencyRecord(
        user_id=user.pk, key=key, fingerprint=fingerprint, request=request[:300]
    )
    with transaction.atomic():
        if insert_or_skip(record, conflict_fields=["user", "key"]):
            perform(record)
            return None
    # The record is committed: the INSERT above waited for a concurrent one to finish.
    existing = IdempotencyRecord.objects.select_related("target_type").get(user_id=user.pk, key=key)
    if existing.fingerprint != fingerprint:
        raise IdempotencyKeyReused(
            f"this {HEADER} was already used for another request ({existing.request}); "
            "use a new key for a new request"
        )
    return existing


def idempotent_perform(
    *,
    user: AbstractBaseUser | AnonymousUser,
    key: str,
    fingerprint: str,
    request: str,
    perform: Callable[[], M | None],
) -> Performed[M]:
    """Run ``perform`` once per (``user``, ``key``) and record what it returned, as above; a repeat
    with another fingerprint raises ``IdempotencyKeyReused``."""
    created: list[M | None] = []

    def record_target(record: IdempotencyRecord) -> None:
        result = perform()
        created.append(result)
        if result is not None:
            record.target_type = ContentType.objects.get_for_model(result)
            record.target_id = result.pk
            record.save(update_fields=["target_type", "target_id"])

    earlier = _once(
        user=user, key=key, fingerprint=fingerprint, request=request, perform=record_target
    )
    if earlier is None:
        return Performed(result=created[0], replayed=False)
    found: M | None = earlier.target
    return Performed(result=found, replayed=True)


@dataclass(frozen=True)
class Responded:
    response: dict[str, Any]  # the first request's answer
    replayed: bool  # True: the key's request was made before; nothing was done now


def idempotent_respond(
    *,
    user: AbstractBaseUser | AnonymousUser,
    key: str,
    fingerprint: str,
    request: str,
    perform: Callable[[], dict[str, Any]],
) -> Responded:
    """Run ``perform`` once per (``user``, ``key``) and keep the JSON answer it returned: the same
    request again gets that answer and does nothing; another request under the key raises
    ``IdempotencyKeyReused``."""
    answered: list[dict[str, Any]] = []

    def record_response(record: IdempotencyRecord) -> None:
        answered.append(perform())
        record.response = answered[0]
        record.save(update_fields=["response"])

    earlier = _once(
        user=user, key=key, fingerprint=fingerprint, request=request, perform=record_response
    )
    if earlier is None:
        return Responded(response=answered[0], replayed=False)
    return Responded(response=earlier.response or {}, replayed=True)
