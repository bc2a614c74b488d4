"""Rows the tests need, built the way the application would have stored them."""

from __future__ import annotations

import itertools
from typing import Any

from django.utils import timezone

from invoicing.models import Invoice

_numbers = itertools.count(1)


def paid_invoice(provider_id: str | None = None, **fields: Any) -> Invoice:
    """A paid invoice, as a webhook stores it; each call a new provider id, number and address
    unless given."""
    n = next(_numbers)
    provider_id = provider_id or f"in_test_{n}"
    values: dict[str, Any] = {
        "number": provider_id.upper(),
        "customer_email": f"{provider_id}@example.com",
        "amount_paid": 100,
        "currency": "usd",
        "status": "paid",
        "provider_updated_at": timezone.now(),
        **fields,
    }
    return Invoice.objects.create(provider_invoice_id=provider_id, **values)
