"""What a verified webhook event is, and which app acts on each event type.

An app declares ``@webhook_handler("invoice.paid", parse=...)`` on the function that applies
those events (``invoicing/webhooks.py``). A type with a handler is stored as ``processed`` and is
essential under backpressure; any other is stored as ``ignored`` and shed first. Snapshot events
and thin events (``v2.core.event``) are declared alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar


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
    # The Stripe API version its object is rendered in; "" if it has none (a thin event).
    api_version: str = ""
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
Apply = TypeVar("Apply", bound=Callable[[Any, Event], None])


def webhook_handler(*event_types: str, parse: Callable[[Any], Any]) -> Callable[[Apply], Apply]:
    """Act on events of ``event_types`` (replacing any handler they had).

    ``parse(data.object)`` runs before anything is stored; ``WebhookRejected`` there is a 400.
    A thin event has no ``data``: ``parse`` gets stripe-python's ``EventNotification`` of it
    (``webhooks.stripe.event_notification``), whose ``related_object`` and ``context`` name what
    a task fetches through the API (the notification itself calls nothing in the request).
    The decorated ``apply(parsed, event)`` runs in the transaction that stores the event, and
    must be idempotent (a reprocess applies it again) and never move state backwards."""

    def declare(apply: Apply) -> Apply:
        for event_type in event_types:
            _handlers[event_type] = Handler(parse=parse, apply=apply)
        return apply

    return declare


def handler_for(event_type: str) -> Handler | None:
    return _handlers.get(event_type)


def handled_types() -> list[str]:
    """The event types with a handler, sorted."""
    return sorted(_handlers)


def event_apply(event: Event) -> None:
    """Apply a handled event (in the caller's transaction); an unhandled one changes nothing."""
    handler = _handlers.get(event.type)
    if event.handled and handler is not None:
        handler.apply(event.data, event)
