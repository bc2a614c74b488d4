"""Webhook deliveries, read-only as received, and a "Reprocess" action under the
``reprocess_webhookevent`` permission."""

from __future__ import annotations

import json
import re

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from asyncwork.contrib.admin.options import ReadOnlyAdmin, admin_actor, has_power
from asyncwork.contrib.operators.admin import OperatorActionInline
from webhooks.models import WebhookEvent
from webhooks.stripe import webhook_event_reprocess

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _pre(text: str) -> str:
    return format_html('<pre style="white-space: pre-wrap; margin: 0">{}</pre>', text)


@admin.register(WebhookEvent)
class WebhookEventAdmin(ReadOnlyAdmin):
    list_display = (
        "event_id",
        "type",
        "verdict",
        "livemode",
        "api_version",
        "source",
        "received_at",
        "error_short",
    )
    list_filter = ("state", "type", "source", "livemode", "api_version")
    search_fields = ("event_id", "type")
    date_hierarchy = "received_at"
    actions = ["reprocess_selected"]
    inlines = [OperatorActionInline]
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "event_id",
                    "type",
                    "livemode",
                    "api_version",
                    "source",
                    "received_at",
                    "verdict",
                    "error",
                )
            },
        ),
        ("Delivery", {"fields": ("body_pretty", "headers_display")}),
        ("Raw body, byte for byte as signed", {"fields": ("body_raw",), "classes": ("collapse",)}),
    )

    @admin.display(description="Verdict", ordering="state")
    def verdict(self, obj: WebhookEvent) -> str:
        # "Duplicate" is an answer, not stored: a duplicate stores nothing.
        return obj.state

    @admin.display(description="Error")
    def error_short(self, obj: WebhookEvent) -> str:
        return obj.error[:80]

    @admin.display(description="Body")
    def body_pretty(self, obj: WebhookEvent) -> str:
        if obj.body_cleared_at is not None:
            return f"Cleared by retention on {obj.body_cleared_at:%Y-%m-%d %H:%M} UTC."
        try:
            text = json.dumps(json.loads(obj.body), indent=2, ensure_ascii=False)
        except (ValueError, RecursionError):
            text = obj.body
        # A signed \\ud800 decodes to a lone surrogate, which no page can encode: show the
        # escape it was signed as.
        return _pre(_LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))

    @admin.display(description="Headers")
    def headers_display(self, obj: WebhookEvent) -> str:
        return _pre("\n".join(f"{name}: {value}" for name, value in sorted(obj.headers.items())))

    @admin.display(description="Raw body")
    def body_raw(self, obj: WebhookEvent) -> str:
        return _pre(obj.body)

    def has_reprocess_permission(self, request: HttpRequest) -> bool:
        return has_power(request, WebhookEvent, "reprocess_webhookevent")

    @admin.action(description="Reprocess selected webhook events", permissions=["reprocess"])
    def reprocess_selected(self, request: HttpRequest, queryset: QuerySet[WebhookEvent]) -> None:
        result = webhook_event_reprocess(
            event_ids=list(queryset.values_list("event_id", flat=True)), actor=admin_actor(request)
        )
        done = len(result.processed) + len(result.ignored) + len(result.failed)
        self.message_user(
            request,
            f"Reprocessed {done} webhook event(s): {len(result.processed)} processed, "
            f"{len(result.ignored)} ignored, {len(result.failed)} failed.",
            messages.WARNING if result.failed else messages.SUCCESS,
        )
        if result.failed:
            self.message_user(
                request,
                f"Failed, the reason is on each event: {', '.join(result.failed[:20])}.",
                messages.WARNING,
            )
        if result.missing:
            self.message_user(
                request, f"Skipped {len(result.missing)} no longer stored.", messages.WARNING
            )
