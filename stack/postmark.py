"""A stand-in of Postmark's email API as Postmark documents it, for django-anymail's own Postmark
backend (``ANYMAIL["POSTMARK_API_URL"]`` pointed at it): an HTTP server on a thread of the
caller's process, on a free loopback port, answering ``POST /email`` with
``X-Postmark-Server-Token`` (401, ``ErrorCode`` 10, otherwise):

* a message to an address in ``invalid``: 422, ``ErrorCode`` 300, "Invalid 'To' address:
  '<address>'." quoting the To field as sent, a display name included, or with
  ``quotes_address`` its address alone (the form anymail's parser expects); or naming
  ``misnamed`` instead, when that is set (a reply about an address we did not send to);
* to an address in ``inactive`` (one that bounced or complained before): 422, ``ErrorCode``
  406, "You tried to send to a recipient that has been marked as inactive";
* any other: 200, ``ErrorCode`` 0, "OK", a new ``MessageID``; the message is kept in ``sent``.

The faults, one per request for the next requests (``fail_next``), before anything else:
``ERROR`` (500), ``RATE_LIMITED`` (429 with ``Retry-After``) and ``HANG`` (no answer for
``hang_seconds``, then the connection closed, the message not taken). ``requests`` counts every
request, faults included.

``bounce_event`` and ``complaint_event`` build the tracking webhook's JSON for a message it
took, as Postmark posts it (``RecordType`` ``Bounce`` or ``SpamComplaint``), with the message's
``Metadata`` carried back.
"""

from __future__ import annotations

import json
import secrets
import uuid
from datetime import UTC, datetime
from typing import Any, cast

from stack.standin import JsonHandler, StandIn, StandInServer

ERROR = "error"
RATE_LIMITED = "rate_limited"
HANG = "hang"

# Postmark's API error codes (its "API error codes" reference).
INVALID_EMAIL_REQUEST = 300
INACTIVE_RECIPIENT = 406
NO_TOKEN = 10


class _Handler(JsonHandler):
    def do_POST(self) -> None:
        api: PostmarkApi = cast(StandInServer, self.server).api
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        fault = api.fault_take()
        if fault == HANG:
            api.hang()
            return
        if fault == ERROR:
            self.send_json(500, {"ErrorCode": 500, "Message": "Internal Server Error"})
            return
        if fault == RATE_LIMITED:
            self.send_json(
                429,
                {"ErrorCode": 429, "Message": "Rate limit exceeded."},
                {"Retry-After": str(api.retry_after)},
            )
            return
        if self.path.rstrip("/") != "/email":
            self.send_json(404, {"ErrorCode": 404, "Message": f"No endpoint {self.path}"})
            return
        try:
            message = json.loads(body)
        except ValueError:
            self.send_json(400, {"ErrorCode": 402, "Message": "Received invalid JSON input."})
            return
        status, answer = api.answer(self.headers.get("X-Postmark-Server-Token"), message)
        self.send_json(status, answer)


class PostmarkApi(StandIn):
    """The stand-in (``stack.standin.StandIn``)."""

    handler = _Handler
    thread_name = "postmark-api"

    def __init__(self, *, token: str | None = None, hang_seconds: float = 5.0) -> None:
        super().__init__(hang_seconds=hang_seconds)
        self.token = token or str(uuid.uuid4())
        self.retry_after = 1
        self.invalid: set[str] = set()
        self.quotes_address = False
        self.misnamed: str | None = None
        self.inactive: set[str] = set()
        self.sent: list[dict[str, Any]] = []  # each message taken, with its MessageID
        self.requests = 0
        self._faults: list[str] = []

    @property
    def url(self) -> str:
        """The API's base URL, as ``ANYMAIL["POSTMARK_API_URL"]`` takes it."""
        return f"{self.address}/"

    def fail_next(self, fault: str, times: int = 1) -> None:
        """Answer the next ``times`` requests (after those already scripted) with ``fault``."""
        with self.lock:
            self._faults.extend([fault] * times)

    def sent_to(self, address: str) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.sent if address.lower() in m["To"].lower()]

    # --- answers ------------------------------------------------------------------------------

    def answer(self, token: str | None, message: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if token != self.token:
            return 401, {
                "ErrorCode": NO_TOKEN,
                "Message": "The Server Token you provided in the X-Postmark-Server-Token "
                "request header was invalid. Please verify that you are using a valid token.",
            }
        to = str(message.get("To", ""))
        address = to.rpartition("<")[2].rstrip(">").strip().lower()
        quoted = address if self.quotes_address else to
        if address in self.invalid:
            return 422, {
                "ErrorCode": INVALID_EMAIL_REQUEST,
                "Message": f"Invalid 'To' address: '{self.misnamed or quoted}'.",
            }
        if address in self.inactive:
            return 422, {
                "ErrorCode": INACTIVE_RECIPIENT,
                "Message": "You tried to send to a recipient that has been marked as inactive.\n"
                f"Found inactive addresses: {address}.\n"
                "Inactive recipients are ones that have generated a hard bounce, a spam "
                "complaint, or a manual suppression. ",
            }
        taken = {
            "To": to,
            "SubmittedAt": datetime.now(UTC).isoformat(),
            "MessageID": str(uuid.uuid4()),
            "ErrorCode": 0,
            "Message": "OK",
        }
        with self.lock:
            self.sent.append({**message, "MessageID": taken["MessageID"]})
        return 200, taken

    def fault_take(self) -> str | None:
        with self.lock:
            self.requests += 1
            return self._faults.pop(0) if self._faults else None

    # --- the tracking webhook's payloads ------------------------------------------------------

    def bounce_event(
        self,
        message: dict[str, Any],
        *,
        kind: str = "HardBounce",
        description: str = "The server was unable to deliver your message (ex: unknown user, "
        "mailbox not found).",
        details: str = "smtp;550 5.1.1 The email account that you tried to reach does not exist.",
    ) -> dict[str, Any]:
        """A ``Bounce`` record of a message this stand-in took, as Postmark posts it."""
        return {
            "RecordType": "Bounce",
            "ID": secrets.randbelow(10**12),
            "Type": kind,
            "TypeCode": 1 if kind == "HardBounce" else 4096,
            "Name": "Hard bounce" if kind == "HardBounce" else kind,
            "Tag": "",
            "MessageID": message["MessageID"],
            "Metadata": message.get("Metadata", {}),
            "ServerID": 23,
            "MessageStream": "outbound",
            "Description": description,
            "Details": details,
            "Email": _address(message["To"]),
            "From": message.get("From", ""),
            "BouncedAt": datetime.now(UTC).isoformat(),
            "DumpAvailable": True,
            "Inactive": kind == "HardBounce",
            "CanActivate": True,
            "Subject": message.get("Subject", ""),
            "Content": "",
        }

    def complaint_event(self, message: dict[str, Any]) -> dict[str, Any]:
        """A ``SpamComplaint`` record of a message this stand-in took."""
        event = self.bounce_event(
            message,
            kind="SpamComplaint",
            description="The subscriber explicitly marked this message as spam.",
            details="Test spam complaint details",
        )
        return {**event, "RecordType": "SpamComplaint", "TypeCode": 512, "Name": "Spam complaint"}


def _address(to: str) -> str:
    return to.rpartition("<")[2].rstrip(">").strip()
