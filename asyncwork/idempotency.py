"""Idempotency keys for API requests: a request retried under its key does its work once.

Stripe's rules, held by PostgreSQL. A request carrying an ``Idempotency-Key`` is an
``IdempotencyRecord`` under a UNIQUE (user, key) constraint, inserted with ``INSERT ... ON
CONFLICT DO NOTHING`` in the same transaction as the work it does:

* a new key: the record is inserted, the work is done and the record points at what it
  created, all in one commit; work that fails rolls the record back too, so the key stays
  unused and a retry does the work;
* the same user, key and request (same fingerprint): nothing is done again, and the caller
  gets what the first request created, to answer from as it is now;
* the same user and key with a different request (another path, object or body):
  ``IdempotencyKeyReused`` (the API answers 422);
* another user with the same key: a request of its own. Keys are scoped to the user;
* concurrently: PostgreSQL makes a second INSERT of the same (user, key) wait for the first
  transaction. After that commits, the second finds the record and does nothing; if it rolls
  back, the second inserts and does the work. No check-then-insert window.

A key is kept as long as its record (no expiry here, unlike Stripe's 24 h): records are small
and made by operators one at a time.
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
    # What the key's request created; None if it was deleted since, or if the request made
    # no one row to answer with (a batch).
    result: M | None
    replayed: bool  # True: the key's request was made before; nothing was done now


def idempotency_key_from(request: Request) -> str:
    """The request's ``Idempotency-Key`` header; a 400 (``ValidationError``) when it is
    missing, blank, longer than 255 characters or holds control characters (PostgreSQL
    refuses a NUL in text: it would be a 500)."""
    key = request.headers.get(HEADER, "").strip()
    if not key:
        raise ValidationError({HEADER: "this header is required"})
    if len(key) > MAX_KEY_LENGTH:
        raise ValidationError({HEADER: f"at most {MAX_KEY_LENGTH} characters"})
    if not key.isprintable():
        raise ValidationError({HEADER: "printable characters only"})
    return key


def _plain(data: Any) -> Any:
    if isinstance(data, QueryDict):
        return sorted(data.lists())
    return data


def request_fingerprint(request: Request, **params: Any) -> str:
    """SHA-256 of what makes a request this request: method, path, query, parsed body, and
    any ``params`` the view resolved from them (an object's id)."""
    described = {
        "method": request.method,
        "path": request.path,
        "query": sorted(request.query_params.lists()),
        "body": _plain(request.data),
        "params": params,
    }
    canonical = json.dumps(described, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def idempotent_perform(
    *,
    user: AbstractBaseUser | AnonymousUser,
    key: str,
    fingerprint: str,
    request: str,
    perform: Callable[[], M | None],
) -> Performed[M]:
    """Run ``perform`` once per (``user``, ``key``): the first call runs it and records what
    it returned (if anything), in one transaction; a later or concurrent call with the same
    fingerprint returns that instead. Raises ``IdempotencyKeyReused`` when the fingerprint
    differs, and whatever ``perform`` raises (nothing is recorded then)."""
    if user.pk is None:
        raise TypeError("an idempotency key belongs to a signed-in user")
    record = IdempotencyRecord(
        user_id=user.pk, key=key, fingerprint=fingerprint, request=request[:300]
    )
    with transaction.atomic():
        if insert_or_skip(record, conflict_fields=["user", "key"]):
            result = perform()
            if result is not None:
                record.target_type = ContentType.objects.get_for_model(result)
                record.target_id = result.pk
                record.save(update_fields=["target_type", "target_id"])
            return Performed(result=result, replayed=False)
    # The record is committed: the INSERT above waited for a concurrent one to finish.
    existing = IdempotencyRecord.objects.select_related("target_type").get(user_id=user.pk, key=key)
    if existing.fingerprint != fingerprint:
        raise IdempotencyKeyReused(
            f"this {HEADER} was already used for another request ({existing.request}); "
            "use a new key for a new request"
        )
    found: M | None = existing.target
    return Performed(result=found, replayed=True)
