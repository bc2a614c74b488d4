"""The webhook events invoicing acts on (``webhooks.events.webhook_handler``).

Free-text fields are made storable rather than refused, so a customer's typo never costs the
payment its record or receipt. Applying is idempotent and never moves an invoice backwards.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from invoicing.services import InvoiceData, invoice_record_payment
from webhooks.events import Event, WebhookRejected, webhook_handler
from webhooks.stripe import field_epoch, field_int, field_text, name_valid

logger = logging.getLogger(__name__)

PAYMENT_EVENT_TYPES = ("invoice.paid", "invoice.payment_succeeded")


def invoice_parse(obj: Any) -> InvoiceData:
    """``data.object`` as the invoice we keep; ``WebhookRejected`` (400) if we cannot key on it."""
    if not isinstance(obj, dict):
        raise WebhookRejected("data.object is missing")
    invoice_id = obj.get("id")
    if invoice_id is None or invoice_id == "":
        raise WebhookRejected("data.object.id is missing")
    if not name_valid(invoice_id):
        raise WebhookRejected("data.object.id is malformed")
    currency = field_text(obj, "currency", limit=3).lower()
    if currency and not re.fullmatch(r"[a-z]{3}", currency):
        raise WebhookRejected("data.object.currency is not a 3-letter code")
    transitions = obj.get("status_transitions")
    paid_at = field_epoch(transitions, "paid_at") if isinstance(transitions, dict) else None
    status = field_text(obj, "status", limit=20) or "paid"
    if status not in {"draft", "open", "paid", "uncollectible", "void"}:
        raise WebhookRejected("data.object.status is not an invoice status")
    return InvoiceData(
        provider_invoice_id=invoice_id,
        number=field_text(obj, "number", limit=255),
        customer_email=field_text(obj, "customer_email", limit=320),
        provider_customer_id=field_text(obj, "customer", limit=255),
        customer_name=field_text(obj, "customer_name", limit=255),
        amount_paid=field_int(obj, "amount_paid") or 0,
        currency=currency,
        status=status,
        hosted_invoice_url=field_text(obj, "hosted_invoice_url", limit=2000),
        paid_at=paid_at,
    )


@webhook_handler(*PAYMENT_EVENT_TYPES, parse=invoice_parse)
def invoice_payment_apply(data: InvoiceData, event: Event) -> None:
    invoice = invoice_record_payment(data=data, provider_time=event.created)
    logger.info(
        "payment event applied",
        extra={
            "event_id": event.id,
            "event_type": event.type,
            "invoice_id": invoice.pk if invoice else None,
            "stale": invoice is None,
        },
    )
