"""Invoices for the operator: the payment email's status at a glance, and a deliberate resend."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from invoicing.mail import format_amount
from invoicing.models import EmailDelivery, Invoice
from invoicing.selectors import (
    EMAIL_STATUSES,
    email_status,
    filter_by_email_status,
    invoices_with_email_status,
)


class EmailDeliveryInline(admin.TabularInline):
    model = EmailDelivery
    extra = 0
    can_delete = False
    fields = (
        "key",
        "state",
        "attempts",
        "sent_at",
        "message_id",
        "last_error",
        "requested_by",
        "created_at",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class EmailStatusFilter(admin.SimpleListFilter):
    title = "email status"
    parameter_name = "email_status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(s, s.replace("_", " ")) for s in EMAIL_STATUSES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return filter_by_email_status(queryset, value) if value in EMAIL_STATUSES else queryset


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = (
        "number",
        "customer_email",
        "amount",
        "status",
        "email_status_display",
        "email_when",
        "paid_at",
    )
    list_filter = ("status", EmailStatusFilter, "currency")
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

    def get_queryset(self, request: HttpRequest) -> QuerySet[Invoice]:
        return invoices_with_email_status()

    @admin.display(description="Amount", ordering="amount_paid")
    def amount(self, obj: Invoice) -> str:
        return format_amount(obj.amount_paid, obj.currency or "usd")

    @admin.display(description="Email")
    def email_status_display(self, obj: Invoice) -> str:
        return email_status(obj).replace("_", "-")

    @admin.display(description="Email sent at", ordering="email_sent_at")
    def email_when(self, obj: Invoice) -> Any:
        return getattr(obj, "email_sent_at", None)
