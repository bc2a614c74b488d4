from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from invoicing.models import EmailDelivery, Invoice


class EmailDeliveryInline(admin.TabularInline):
    model = EmailDelivery
    extra = 0
    can_delete = False
    fields = ("key", "state", "attempts", "sent_at", "message_id", "last_error", "requested_by")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Invoice | None = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ("number", "customer_email", "amount_paid", "currency", "status", "paid_at")
    list_filter = ("status", "currency")
    search_fields = ("number", "customer_email", "provider_invoice_id")
    inlines = [EmailDeliveryInline]
    readonly_fields = (
        "provider_invoice_id",
        "amount_paid",
        "currency",
        "status",
        "paid_at",
        "provider_updated_at",
        "created_at",
        "updated_at",
    )
