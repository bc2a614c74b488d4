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
    body = models.TextField(help_text="The raw body exactly as received.")
    headers = models.JSONField(default=dict)
    # Set when retention cleared body and headers; the row, and its dedupe, stays.
    body_cleared_at = models.DateTimeField(null=True, blank=True)
    received_at = models.DateTimeField(auto_now_add=True, db_index=True)
    state = models.CharField(max_length=10, choices=State.choices)
    error = models.TextField(blank=True)

    class Meta:
        permissions = [("reprocess_webhookevent", "Can reprocess webhook event")]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"
