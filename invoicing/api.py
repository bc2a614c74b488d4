"""REST API for invoices (staff only): their payment email's status and attempts."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, viewsets
from rest_framework.exceptions import ValidationError

from invoicing.models import Invoice
from invoicing.selectors import (
    EMAIL_STATUSES,
    email_status,
    filter_by_email_status,
    invoices_with_email_status,
)


class InvoiceSerializer(serializers.ModelSerializer[Invoice]):
    email_status = serializers.SerializerMethodField()
    email_attempts = serializers.IntegerField(read_only=True, default=0)
    email_sent_at = serializers.DateTimeField(read_only=True, allow_null=True)

    class Meta:
        model = Invoice
        fields = (
            "id",
            "provider_invoice_id",
            "number",
            "customer_email",
            "customer_name",
            "amount_paid",
            "currency",
            "status",
            "hosted_invoice_url",
            "paid_at",
            "email_status",
            "email_attempts",
            "email_sent_at",
            "created_at",
            "updated_at",
        )
        read_only_fields = fields

    def get_email_status(self, obj: Invoice) -> str:
        return email_status(obj)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(
                "status",
                OpenApiTypes.STR,
                enum=[c.value for c in Invoice.Status],
                description="Invoice status.",
            ),
            OpenApiParameter(
                "email_status",
                OpenApiTypes.STR,
                enum=list(EMAIL_STATUSES),
                description="Status of the payment email.",
            ),
        ]
    )
)
class InvoiceViewSet(viewsets.ReadOnlyModelViewSet[Invoice]):
    serializer_class = InvoiceSerializer

    def get_queryset(self) -> QuerySet[Invoice]:
        queryset = invoices_with_email_status().order_by("-pk")
        if self.action != "list":
            return queryset
        status = self.request.query_params.get("status")
        if status is not None:
            if status not in Invoice.Status.values:
                raise ValidationError({"status": f"one of {', '.join(Invoice.Status.values)}"})
            queryset = queryset.filter(status=status)
        wanted = self.request.query_params.get("email_status")
        if wanted is not None:
            if wanted not in EMAIL_STATUSES:
                raise ValidationError({"email_status": f"one of {', '.join(EMAIL_STATUSES)}"})
            queryset = filter_by_email_status(queryset, wanted)
        return queryset
