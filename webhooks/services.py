"""The webhook guarantee: a verified delivery is stored once, under the provider's event id,
together with its effect, in one transaction.

The event row is inserted with ``ON CONFLICT (event_id) DO NOTHING``: a duplicate delivery,
sequential or concurrent, finds the row (or waits for the transaction inserting it) and
changes nothing, without an IntegrityError anywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction

from core.db import insert_or_skip
from invoicing.services import invoice_record_payment
from webhooks.models import WebhookEvent
from webhooks.stripe import Event

logger = logging.getLogger(__name__)

# Request headers kept with each delivery (lower-case WSGI names -> stored names).
KEPT_HEADERS = {
    "HTTP_STRIPE_SIGNATURE": "Stripe-Signature",
    "HTTP_USER_AGENT": "User-Agent",
    "CONTENT_TYPE": "Content-Type",
    "HTTP_X_FORWARDED_FOR": "X-Forwarded-For",
    "REMOTE_ADDR": "Remote-Addr",
}


@dataclass(frozen=True)
class Recorded:
    event_id: str
    duplicate: bool
    state: str


def webhook_event_record(*, event: Event, body: str, headers: dict[str, str]) -> Recorded:
    """Store a verified event and apply it, or recognise it as a duplicate and do nothing."""
    acted_on = event.invoice is not None
    row = WebhookEvent(
        event_id=event.id,
        type=event.type,
        livemode=event.livemode,
        body=body,
        headers=headers,
        state=WebhookEvent.State.PROCESSED if acted_on else WebhookEvent.State.IGNORED,
    )
    with transaction.atomic():
        if not insert_or_skip(row, conflict_fields=["event_id"]):
            logger.info("duplicate webhook delivery", extra={"event_id": event.id})
            return Recorded(event_id=event.id, duplicate=True, state="duplicate")
        if event.invoice is not None:
            invoice = invoice_record_payment(data=event.invoice, provider_time=event.created)
            logger.info(
                "payment event applied",
                extra={
                    "event_id": event.id,
                    "event_type": event.type,
                    "invoice_id": invoice.pk if invoice else None,
                    "stale": invoice is None,
                },
            )
    return Recorded(event_id=event.id, duplicate=False, state=row.state)
