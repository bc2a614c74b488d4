"""How long webhook deliveries are kept (``asyncwork.contrib.periodic.retention``).

Bodies and headers (personal data) go after ``WEBHOOK_BODY_RETENTION_DAYS``; the row still
deduplicates. Processed or ignored rows go after ``WEBHOOK_RETENTION_DAYS``; failed ones stay.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

from asyncwork.contrib.periodic.retention import batched_delete, batched_update, retention_rule
from webhooks.models import WebhookEvent


# Declared first, so run first: an event past both retentions is cleared, then deleted.
@retention_rule("webhook_bodies_cleared")
def webhook_bodies_clear(now: datetime, batch: int) -> int:
    uncleared = WebhookEvent.objects.filter(
        received_at__lt=now - timedelta(days=settings.WEBHOOK_BODY_RETENTION_DAYS),
        body_cleared_at__isnull=True,
    )
    return batched_update(uncleared, batch=batch, body="", headers={}, body_cleared_at=now)


@retention_rule("webhook_events")
def webhook_events_purge(now: datetime, batch: int) -> int:
    done = WebhookEvent.objects.filter(
        received_at__lt=now - timedelta(days=settings.WEBHOOK_RETENTION_DAYS),
        state__in=[WebhookEvent.State.PROCESSED, WebhookEvent.State.IGNORED],
    )
    return batched_delete(done, batch=batch)
