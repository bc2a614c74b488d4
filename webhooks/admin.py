from __future__ import annotations

from django.contrib import admin

from core.admin import ReadOnlyAdmin
from webhooks.models import WebhookEvent


@admin.register(WebhookEvent)
class WebhookEventAdmin(ReadOnlyAdmin):
    list_display = ("event_id", "type", "state", "received_at")
    list_filter = ("type", "state")
    search_fields = ("event_id",)
    readonly_fields = (
        "event_id",
        "type",
        "livemode",
        "body",
        "headers",
        "received_at",
        "state",
        "error",
    )
