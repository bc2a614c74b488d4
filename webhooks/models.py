"""Verified webhook deliveries, each stored once under the provider's event id."""

from __future__ import annotations

from django.db import models


class WebhookEvent(models.Model):
    class State(models.TextChoices):
        PROCESSED = "processed", "Processed"
        IGNORED = "ignored", "Ignored (type not acted on)"
        FAILED = "failed", "Failed"

    class Source(models.TextChoices):
        WEBHOOK = "webhook", "Webhook"
        EVENTS_API = "events_api", "Events API (recovered by the reconcile)"

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
    # How it first reached us: delivered, or found in the Events API by ``webhooks.reconcile``
    # (a delivery Stripe never made, or had not made yet). The database's default too, so that
    # processes of the previous release insert while the migration runs.
    source = models.CharField(
        max_length=10, choices=Source.choices, default=Source.WEBHOOK, db_default=Source.WEBHOOK
    )

    class Meta:
        permissions = [("reprocess_webhookevent", "Can reprocess webhook event")]
        indexes = [models.Index(fields=["api_version", "received_at"], name="webhook_version_idx")]

    def __str__(self) -> str:
        return f"{self.type} {self.event_id}"


class EventsCursor(models.Model):
    """How far ``stripe-events-reconcile`` has read Stripe's Events API: one row, named by the
    job. Every event created from ``covered_from`` to ``covered_until`` was recorded by the walks
    that set them (each walk starts an overlap before the last one ended, or further back). A
    walk lists the events created since ``walk_since``, from the newest down; it spans runs when
    it is long, and ``walk_after`` is the last event it recorded. When each run started and what
    it did is its job's ``ScheduledJob`` row."""

    name = models.CharField(max_length=100, primary_key=True)
    covered_from = models.DateTimeField(null=True, blank=True)
    covered_until = models.DateTimeField(null=True, blank=True)
    # Set while a walk is under way: the oldest creation time it lists.
    walk_since = models.DateTimeField(null=True, blank=True)
    walk_started_at = models.DateTimeField(null=True, blank=True)
    walk_after = models.CharField(max_length=255, blank=True)
    # Stripe answered 429 with Retry-After: no call before then.
    not_before = models.DateTimeField(null=True, blank=True)
    recovered_total = models.PositiveBigIntegerField(default=0)
    last_recovered = models.PositiveIntegerField(default=0)
    # Why the last run stopped before its walk's end ("" if it did not): the walk waits there.
    last_error = models.TextField(blank=True)

    def __str__(self) -> str:
        return self.name
