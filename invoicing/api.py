"""REST API for invoices (staff only): their payment email's status and attempts. Reading
needs the view permission and a resend the ``invoicing.resend_invoice_email`` power too
(``core.permissions``)."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from invoicing.models import Invoice
from invoicing.selectors import (
    EMAIL_STATUSES,
    email_status,
    filter_by_email_status,
    invoices_with_email_status,
)
from invoicing.services import invoice_email_resend_request


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
            "recipient_override",
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


class ResendSerializer(serializers.Serializer[None]):
    delivery_id = serializers.IntegerField()
    invoice_id = serializers.IntegerField()
    key = serializers.CharField()
    message_id = serializers.CharField()
    requested_by = serializers.CharField()
    requested_at = serializers.DateTimeField()


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=True,
    description="Any unique string, at most 255 characters. Retrying with the same key "
    "returns the first response and sends nothing more; a new key sends again.",
)


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
    action_permissions = {"resend_email": "invoicing.resend_invoice_email"}

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

    @extend_schema(request=None, parameters=[IDEMPOTENCY_KEY], responses={202: ResendSerializer})
    @action(detail=True, methods=["post"], url_path="resend-email")
    def resend_email(self, request: Request, pk: str | None = None) -> Response:
        """Send the invoice email again, deliberately, under the request's own key."""
        key = request.headers.get("Idempotency-Key", "").strip()
        if not key:
            raise ValidationError({"Idempotency-Key": "this header is required"})
        if len(key) > 255:
            raise ValidationError({"Idempotency-Key": "at most 255 characters"})
        invoice = self.get_object()
        try:
            result = invoice_email_resend_request(
                invoice_id=invoice.pk,
                idempotency_key=key,
                actor=f"api:{request.user.get_username()}",
            )
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        delivery = result.delivery
        return Response(
            {
                "delivery_id": delivery.pk,
                "invoice_id": invoice.pk,
                "key": delivery.key,
                "message_id": delivery.message_id,
                "requested_by": delivery.requested_by,
                "requested_at": delivery.created_at,
            },
            status=status.HTTP_202_ACCEPTED,
        )
