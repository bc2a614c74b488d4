"""Verified webhook deliveries, each stored once under the provider's event id."""

from __future__ import annotations

from django.db import models


class WebhookEvent(models.Model):
    class State(models.TextChoices):
        PROCESSED = "processed", "Processed"
        IGNORED = "ignored", "Ignored (type not acted on)"
        FAILED = "failed", "Failed"

    # UNIQUE: a provider retry, or a concurrent duplicate, cannot store a second row.
    event_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=255, db_index=True)
    livemode = models.BooleanField(default=False)
    # The Stripe API version the event's object is rendered in; "" for a thin event, which has
    # none. Indexed with the time for the /health/ count by version (``webhooks.probes``).
    api_version = models.CharField(max_length=64, blank=True, default="")
    body = models.TextField(help_text="The raw body exactly as received.")
    headers = models.JSONField(default=dict)
    # Set when retention cleared body and headers; the row, and its dedupe, stays.
    body_cleared_at = models.DateTimeField(null=True, blank=True)
    received_at = models.DateTimeField(auto_now_add=True, db_index=True)
    state = models.CharField(max_length=10, choices=State.choices)
    error = models.TextField(blank=True)

    class Meta:
        permissions = [("reprocess_webhookevent", "Can reprocess webhook event")]
        indexes = [models.Index(fields=["api_version", "received_at"], name="webhook_version_idx")]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"
