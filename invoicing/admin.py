"""Invoices for the operator: the payment email's status, a deliberate resend, and a correction
of the recipient, each action under its permission.

An invoice's fields are the provider's and read-only: its next event would replace an edit. A
resend asks first, stating the count, and sends a selection once however often it is confirmed."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from asyncwork import deadletters
from asyncwork.contrib.admin.options import ReadOnlyAdmin, admin_actor, has_power
from asyncwork.contrib.idempotency import IdempotencyKeyReused
from asyncwork.contrib.operators.admin import OperatorActionInline
from invoicing.models import EmailDelivery, Invoice
from invoicing.selectors import (
    EMAIL_STATUSES,
    email_status,
    filter_by_email_status,
    invoice_dead_letters,
    invoices_with_email_status,
)
from invoicing.services import (
    InvoiceData,
    invoice_email_resend_selection_once,
    invoice_recipient_correct,
    recipient_now,
)
from invoicing.tasks import format_amount

# A misclick on "select all" must not mail a whole customer base; more go through the API.
RESEND_SELECTION_MAX = 100

# As the provider sent them, but the amount as money ("20.00 USD"; the provider's minor units are
# ``amount_paid``).
PROVIDER_FIELDS = (
    *("amount" if f.name == "amount_paid" else f.name for f in dataclasses.fields(InvoiceData)),
    "provider_updated_at",
)


class EmailDeliveryInline(admin.TabularInline):
    model = EmailDelivery
    extra = 0
    can_delete = False
    fields = (
        "key",
        "state",
        "recipient",
        "attempts",
        "last_error",
        "message_id_display",
        "sent_at",
        "bounced_at",
        "requested_by",
        "created_at",
    )
    readonly_fields = fields

    @admin.display(description="Message-ID")
    def message_id_display(self, obj: EmailDelivery) -> str:
        return obj.message_id

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(EmailDelivery)
class EmailDeliveryAdmin(ReadOnlyAdmin):
    """Every email, read-only: the dashboard's email figures link here, filtered."""

    list_display = (
        "key",
        "invoice_link",
        "state",
        "recipient",
        "attempts",
        "sent_at",
        "message_id",
        "last_error_short",
    )
    list_filter = ("state", ("sent_at", admin.DateFieldListFilter))
    search_fields = (
        "key",
        "message_id",
        "provider_message_id",
        "recipient",
        "invoice__number",
        "invoice__provider_invoice_id",
    )
    date_hierarchy = "created_at"
    fields = (
        "key",
        "invoice_link",
        "state",
        "attempts",
        "last_error",
        "message_id",
        "provider_message_id",
        "recipient",
        "sent_at",
        "bounced_at",
        "claimed_by",
        "lease_expires_at",
        "requested_by",
        "created_at",
        "updated_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[EmailDelivery]:
        return super().get_queryset(request).select_related("invoice")

    @admin.display(description="Invoice", ordering="invoice__number")
    def invoice_link(self, obj: EmailDelivery) -> str:
        url = reverse("admin:invoicing_invoice_change", args=[obj.invoice_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.invoice))

    @admin.display(description="Last error")
    def last_error_short(self, obj: EmailDelivery) -> str:
        return obj.last_error[:100]


class EmailStatusFilter(admin.SimpleListFilter):
    title = "email status"
    parameter_name = "email_status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(s, s.replace("_", " ")) for s in EMAIL_STATUSES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return filter_by_email_status(queryset, value) if value in EMAIL_STATUSES else queryset


class RecipientCorrectionForm(forms.Form):
    email = forms.EmailField(
        max_length=320,
        required=False,
        label="Send this invoice's emails to",
        help_text="Empty: remove the correction and use the provider's address again.",
    )
    reason = forms.CharField(
        max_length=500,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="Why, for the record (a ticket, who asked).",
    )


@admin.register(Invoice)
class InvoiceAdmin(ReadOnlyAdmin):
    list_display = (
        "number",
        "customer_email",
        "recipient_override",
        "amount",
        "status",
        "email_status_display",
        "email_when",
        "paid_at",
    )
    list_filter = ("status", EmailStatusFilter, "currency")
    search_fields = ("number", "customer_email", "recipient_override", "provider_invoice_id")
    inlines = [EmailDeliveryInline, OperatorActionInline]
    actions = ["resend_email"]
    fieldsets = (
        ("From the provider (its next event replaces them)", {"fields": PROVIDER_FIELDS}),
        (
            "Recipient",
            {
                "fields": ("recipient_override", "recipient"),
                "description": "An operator's correction of where the emails go: "
                "the provider's events leave it as it is.",
            },
        ),
        (
            "Dead letters",
            {
                "fields": ("dead_letters",),
                "description": "This invoice's emails that failed for good, waiting or "
                "replayed. One that failed on its address: correct the recipient (the button "
                "at the top of the page), then open its dead letter and replay it.",
            },
        ),
        (None, {"fields": ("created_at", "updated_at")}),
    )

    def has_resend_email_permission(self, request: HttpRequest) -> bool:
        return has_power(request, Invoice, "resend_invoice_email")

    def has_correct_recipient_permission(self, request: HttpRequest) -> bool:
        return has_power(request, Invoice, "correct_invoice_recipient")

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own URLs, whose "<object_id>/" would otherwise take it.
        return [
            path(
                "<path:object_id>/correct-recipient/",
                self.admin_site.admin_view(self.correct_recipient_view),
                name="invoicing_invoice_correct_recipient",
            ),
            *super().get_urls(),
        ]

    def correct_recipient_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not (
            self.has_view_permission(request) and self.has_correct_recipient_permission(request)
        ):
            raise PermissionDenied
        invoice = self.get_object(request, unquote(object_id))
        if invoice is None:
            raise Http404(f"no invoice with id {object_id}")
        form = RecipientCorrectionForm(
            request.POST if request.method == "POST" else None,
            initial={"email": invoice.recipient_override},
        )
        if form.is_valid():
            try:
                invoice = invoice_recipient_correct(
                    invoice_id=invoice.pk,
                    email=form.cleaned_data["email"],
                    reason=form.cleaned_data["reason"],
                    actor=admin_actor(request),
                )
            except ValueError as exc:
                form.add_error("email", str(exc))
            else:
                self.message_user(
                    request,
                    f"Invoice {invoice}: {recipient_now(invoice)}. Nothing was sent: replay "
                    "its dead letter or resend the email.",
                    messages.SUCCESS,
                )
                return HttpResponseRedirect(
                    reverse("admin:invoicing_invoice_change", args=[invoice.pk])
                )
        context = {
            **self.admin_site.each_context(request),
            "title": "Correct the recipient",
            "subtitle": str(invoice),
            "opts": self.opts,
            "original": invoice,
            "form": form,
            "media": self.media + form.media,
        }
        return TemplateResponse(request, "admin/invoicing/invoice/correct_recipient.html", context)

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

    @admin.display(description="Emails go to")
    def recipient(self, obj: Invoice) -> str:
        return obj.recipient

    @admin.display(description="Dead letters")
    def dead_letters(self, obj: Invoice) -> str:
        """Each dead letter linked to its page (where it is replayed), and all in the list."""
        letters = list(invoice_dead_letters(obj)[:50])
        if not letters:
            return "none"
        items = format_html_join(
            "",
            '<li><a href="{}">Dead letter {}</a>: {}, {} ago. {}</li>',
            (
                (
                    reverse("admin:asyncwork_deadletter_change", args=[letter.pk]),
                    letter.pk,
                    deadletters.replay_state(letter),
                    deadletters.age(letter),
                    deadletters.failure(letter),
                )
                for letter in letters
            ),
        )
        listed = (
            reverse("admin:asyncwork_deadletter_changelist")
            + "?"
            + urlencode({"id__in": ",".join(str(letter.pk) for letter in letters)})
        )
        return format_html(
            '<ul class="dead-letters">{}</ul><a href="{}">Show them in the dead-letter list</a>',
            items,
            listed,
        )

    @admin.action(description="Resend invoice email", permissions=["resend_email"])
    def resend_email(
        self, request: HttpRequest, queryset: QuerySet[Invoice]
    ) -> TemplateResponse | None:
        """A confirmation page with the count, carrying a key made for this selection; the
        confirmed resend runs under that key, so submitting it twice sends once."""
        selected = list(queryset.order_by("pk")[: RESEND_SELECTION_MAX + 1])
        if len(selected) > RESEND_SELECTION_MAX:
            self.message_user(
                request,
                f"{queryset.count()} invoices selected: at most {RESEND_SELECTION_MAX} are "
                "resent from here at once, and nothing was sent. For more, use the API from "
                "the command line, one request per invoice: POST "
                "/api/invoices/<id>/resend-email/ with an Idempotency-Key "
                "(docs/reference/api.md, Invoices).",
                messages.ERROR,
            )
            return None
        if request.POST.get("post") != "yes":
            return self._resend_email_confirmation(request, selected)
        try:
            key = str(uuid.UUID(request.POST.get("idempotency_key", "")))
        except ValueError:
            self.message_user(
                request,
                "This confirmation carries no valid key, and nothing was sent: choose the "
                "action again.",
                messages.ERROR,
            )
            return None
        try:
            result = invoice_email_resend_selection_once(
                invoice_ids=[invoice.pk for invoice in selected],
                user=request.user,
                idempotency_key=key,
                actor=admin_actor(request),
            )
        except IdempotencyKeyReused:
            self.message_user(
                request,
                "This confirmation was made for another selection, and nothing was sent: "
                "choose the action again.",
                messages.ERROR,
            )
            return None
        if result.replayed:
            self.message_user(
                request,
                f"This confirmation was already submitted: its {len(result.requested)} invoice "
                "email resend(s) were requested then, and nothing was sent again.",
                messages.WARNING,
            )
            return None
        self.message_user(
            request, f"Requested {len(result.requested)} invoice email resend(s).", messages.SUCCESS
        )
        if result.skipped:
            skipped = set(result.skipped)
            names = [str(invoice) for invoice in selected if invoice.pk in skipped]
            self.message_user(
                request,
                f"Skipped {len(names)} unpaid invoice(s): {', '.join(names[:20])}.",
                messages.WARNING,
            )
        return None

    def _resend_email_confirmation(
        self, request: HttpRequest, selected: list[Invoice]
    ) -> TemplateResponse | None:
        paid = [invoice for invoice in selected if invoice.status == Invoice.Status.PAID]
        if not paid:
            self.message_user(
                request,
                "None of the selected invoices is paid: nothing to resend.",
                messages.WARNING,
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Resend invoice emails?",
            "opts": self.opts,
            "selected": selected,
            "paid": paid,
            "unpaid": [invoice for invoice in selected if invoice.status != Invoice.Status.PAID],
            # The selection's key, made once for this page: submitting it twice sends once.
            "idempotency_key": uuid.uuid4(),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        return TemplateResponse(
            request, "admin/invoicing/invoice/resend_email_confirmation.html", context
        )
