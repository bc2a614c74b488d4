"""What a verified webhook event is, and which app acts on each event type.

``webhooks`` verifies, stores once and dispatches; what an event *means* belongs to
the app that handles its type, which this app does not name. An app registers a handler per
event type with ``handler_register`` from its ``AppConfig.ready()``:

* ``parse`` reads the event's ``data.object`` into what ``apply`` needs, before anything is
  stored, and raises ``WebhookRejected`` (a 400, nothing stored) for an object it cannot act on;
* ``apply`` acts on it inside the transaction that stores the event, so the event row and its
  effect commit together or not at all; it must be idempotent, since a reprocess applies a
  stored event again.

An event type with a handler is one this endpoint acts on: it is stored as ``processed`` and is
essential under backpressure. Any other type is stored as ``ignored`` and shed first. Adding an
event type is one handler and its registration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class WebhookRejected(Exception):
    """A delivery we refuse, with a short reason for the 4xx body."""

    def __init__(self, reason: str, *, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Event:
    id: str
    type: str
    created: datetime
    livemode: bool
    # Set when this endpoint acts on the event: what its handler's parse made of data.object.
    handled: bool = False
    data: Any = None
    # Why this endpoint does not act on it (another mode or account), or "" if it may.
    out_of_scope: str = ""


@dataclass(frozen=True)
class Handler:
    parse: Callable[[Any], Any]
    apply: Callable[[Any, Event], None]


_handlers: dict[str, Handler] = {}


def handler_register(
    event_type: str,
    *,
    parse: Callable[[Any], Any],
    apply: Callable[[Any, Event], None],
) -> None:
    """Act on events of ``event_type`` (or replace its handler): ``parse(data.object)`` when
    the event is read, ``apply(parsed, event)`` in the transaction that stores it."""
    _handlers[event_type] = Handler(parse=parse, apply=apply)


def handler_for(event_type: str) -> Handler | None:
    return _handlers.get(event_type)


def event_apply(event: Event) -> None:
    """Apply a handled event (in the caller's transaction); an unhandled one changes nothing."""
    handler = _handlers.get(event.type)
    if event.handled and handler is not None:
        handler.apply(event.data, event)
