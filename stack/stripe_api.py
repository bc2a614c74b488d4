"""A stand-in of the Stripe API as Stripe documents it, for the real stripe-python client: an
HTTP server on a thread of the caller's process, on a free loopback port, answering

* ``GET /v1/customers/{id}``, ``GET /v1/invoices/{id}``, ``GET /v1/billing/meters/{id}`` and
  ``GET /v1/events/{id}``: the object put in ``customers``, ``invoices``, ``meters`` or by
  ``event_add``; an unknown id is 404
  (``resource_missing``);
* ``GET /v1/events``: a list object (``object: "list"``, ``data``, ``has_more``, ``url``),
  newest first, filtered by ``types[]``, ``created[gte]`` and ``delivery_success``, paged by
  ``limit`` (1 to 100, default 10) and ``starting_after``;
* of the events added, only those created in the last ``EVENTS_KEPT_SECONDS`` (30 days), listed
  or by id, as Stripe "only returns events created in the last 30 days";

only to ``Authorization: Bearer <key>`` (401 otherwise). Every error is Stripe's shape,
``{"error": {"type", "code", "message"}}``.

The faults, one per request for the next requests (``fail_next``), before anything else:
``ERROR`` (500), ``RATE_LIMITED`` (429 with ``Retry-After``), ``HANG`` (no answer for
``hang_seconds``, then the connection closed: longer than the client's timeout) and
``MALFORMED`` (200 with a body that is not JSON). ``requests`` records each path asked, faults
included, for a test that counts calls, ``versions`` the ``Stripe-Version`` each asked for and
``contexts`` its ``Stripe-Context`` (the connected account it acts as; None: the platform).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

from stack.standin import JsonHandler, StandIn, StandInServer

ERROR = "error"
RATE_LIMITED = "rate_limited"
HANG = "hang"
MALFORMED = "malformed"

EVENTS_KEPT_SECONDS = 30 * 86400

_OBJECT = re.compile(r"/v1/(customers|invoices|billing/meters|events)/([^/]+)")
_TYPES = re.compile(r"types\[\d*\]")


class ApiError(Exception):
    """An answer in Stripe's error shape."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"type": kind, "code": code or None, "message": message}}


class _Handler(JsonHandler):
    def do_GET(self) -> None:
        api: StripeApi = cast(StandInServer, self.server).api
        fault = api.fault_take(
            self.path, self.headers.get("Stripe-Version"), self.headers.get("Stripe-Context")
        )
        if fault == HANG:
            api.hang()
            return
        if fault == MALFORMED:
            self._send(200, b'{"object": "customer", "id": ')
            return
        try:
            if fault == ERROR:
                raise ApiError(500, "Sorry, something went wrong.", kind="api_error")
            if fault == RATE_LIMITED:
                raise ApiError(429, "Too many requests hit the API too quickly.", code="rate_limit")
            status, body = api.answer(self.path, self.headers.get("Authorization"))
        except ApiError as exc:
            status, body = exc.status, exc.body
        extra = {"Retry-After": str(api.retry_after)} if status == 429 else {}
        self._send(status, json.dumps(body).encode(), extra)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_json(
            status, body, {"Request-Id": f"req_{secrets.token_hex(7)}", **(headers or {})}
        )


class StripeApi(StandIn):
    """The stand-in (``stack.standin.StandIn``)."""

    handler = _Handler
    thread_name = "stripe-api"

    def __init__(self, *, key: str | None = None, hang_seconds: float = 5.0) -> None:
        super().__init__(hang_seconds=hang_seconds)
        self.key = key or f"rk_test_{secrets.token_hex(12)}"
        self.retry_after = 1
        self.customers: dict[str, dict[str, Any]] = {}
        self.meters: dict[str, dict[str, Any]] = {}
        self.invoices: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []  # in the order they were added
        self.undelivered: set[str] = set()  # event ids whose webhooks all failed
        self.requests: list[str] = []
        self.versions: list[str | None] = []  # each request's Stripe-Version header
        self.contexts: list[str | None] = []  # and its Stripe-Context header
        self._faults: list[str] = []

    @property
    def url(self) -> str:
        return self.address

    def event_add(self, event: dict[str, Any], *, delivered: bool = True) -> None:
        """Add an event; ``delivered`` False: listed by ``delivery_success=false``."""
        with self.lock:
            self.events.append(event)
            if not delivered:
                self.undelivered.add(event["id"])

    def fail_next(self, fault: str, times: int = 1) -> None:
        """Answer the next ``times`` requests (after those already scripted) with ``fault``."""
        with self.lock:
            self._faults.extend([fault] * times)

    # --- answers ------------------------------------------------------------------------------

    def answer(self, path: str, authorization: str | None) -> tuple[int, dict[str, Any]]:
        """The status and JSON body for ``GET path``, or ``ApiError``."""
        if authorization != f"Bearer {self.key}":
            raise ApiError(401, "Invalid API Key provided")
        url = urlsplit(path)
        if url.path == "/v1/events":
            return 200, self._events_list(parse_qsl(url.query))
        found = _OBJECT.fullmatch(url.path)
        if found is None:
            raise ApiError(404, f"Unrecognized request URL (GET: {url.path})")
        kind, object_id = found.groups()
        with self.lock:
            objects = {
                "customers": self.customers,
                "billing/meters": self.meters,
                "invoices": self.invoices,
                "events": {event["id"]: event for event in self._events_kept()},
            }[kind]
            obj = objects.get(object_id)
        if obj is None:
            what = kind.rpartition("/")[2][:-1]  # "customer", "meter"
            raise ApiError(404, f"No such {what}: '{object_id}'", code="resource_missing")
        return 200, obj

    def _events_list(self, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        query = dict(pairs)
        try:
            limit = int(query.get("limit", "10"))
            created_gte = int(query.get("created[gte]", "0"))
        except ValueError:
            raise ApiError(400, "Invalid integer", code="parameter_invalid_integer") from None
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100", code="parameter_invalid")
        types = {value for name, value in pairs if _TYPES.fullmatch(name)}
        delivered = {"true": True, "false": False}.get(query.get("delivery_success", ""))
        with self.lock:
            # Newest first; of one second, the last added first.
            listed = [
                event
                for event in sorted(
                    reversed(self._events_kept()), key=lambda e: e["created"], reverse=True
                )
                if (not types or event["type"] in types)
                and event["created"] >= created_gte
                and (delivered is None or (event["id"] not in self.undelivered) == delivered)
            ]
        after = query.get("starting_after")
        if after is not None:
            ids = [event["id"] for event in listed]
            if after not in ids:
                raise ApiError(404, f"No such event: '{after}'", code="resource_missing")
            listed = listed[ids.index(after) + 1 :]
        return {
            "object": "list",
            "data": listed[:limit],
            "has_more": len(listed) > limit,
            "url": "/v1/events",
        }

    def _events_kept(self) -> list[dict[str, Any]]:
        """The events Stripe still has (the lock held)."""
        oldest = time.time() - EVENTS_KEPT_SECONDS
        return [event for event in self.events if event["created"] >= oldest]

    def fault_take(self, path: str, version: str | None, context: str | None) -> str | None:
        """Record a request to ``path`` in ``version``; the fault it gets, if one is scripted."""
        with self.lock:
            self.requests.append(path)
            self.versions.append(version)
            self.contexts.append(context)
            return self._faults.pop(0) if self._faults else None
