"""Invoices for the operator: the payment email's status at a glance, and a deliberate resend."""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin, messages
from django.db import models
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
from invoicing.services import invoice_email_resend_request


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
    actions = ["resend_email"]
    # The provider's invoice URLs are https (and Django 6 defaults to it; 5.2 warns without).
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}
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

    @admin.action(description="Resend invoice email")
    def resend_email(self, request: HttpRequest, queryset: QuerySet[Invoice]) -> None:
        """A deliberate new email per selected paid invoice, each under a key of its own (the
        payment email's key is never touched), recording who asked; the service decides what
        may be resent."""
        # One idempotency key per click: the service derives each invoice's key from it.
        click = str(uuid.uuid4())
        actor = f"admin:{request.user.get_username()}"
        requested, skipped = 0, []
        for invoice in queryset.order_by("pk"):
            try:
                invoice_email_resend_request(
                    invoice_id=invoice.pk, idempotency_key=click, actor=actor
                )
            except (Invoice.DoesNotExist, ValueError):
                skipped.append(str(invoice))
                continue
            requested += 1
        self.message_user(
            request, f"Requested {requested} invoice email resend(s).", messages.SUCCESS
        )
        if skipped:
            self.message_user(
                request,
                f"Skipped {len(skipped)} unpaid invoice(s): {', '.join(skipped[:20])}.",
                messages.WARNING,
            )
