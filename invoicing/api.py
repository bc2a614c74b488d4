"""REST API for invoices (staff only): their payment email's status and attempts, a resend, and
the correction of where their emails go. Reading needs the view permission; a resend needs the
``invoicing.resend_invoice_email`` power too, a correction
``invoicing.correct_invoice_recipient`` (``asyncwork.contrib.permissions``)."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from asyncwork.contrib.api import query_filter
from asyncwork.contrib.idempotency import (
    IdempotencyKeyReused,
    idempotency_key_from,
    request_fingerprint,
)
from invoicing.models import EmailDelivery, Invoice
from invoicing.selectors import (
    EMAIL_STATUSES,
    email_delivery_outcome,
    email_status,
    filter_by_email_status,
    invoices_with_email_status,
)
from invoicing.services import (
    RecipientUnchanged,
    invoice_email_resend_request_once,
    invoice_recipient_correct,
    recipient_now,
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
    status = serializers.ChoiceField(
        choices=("queued", "sent", "failed"),
        help_text="What the request did, now: queued (waiting, sending or between attempts), "
        "sent, or failed (dead-lettered; replaying the dead letter queues it again).",
    )
    attempts = serializers.IntegerField()
    sent_at = serializers.DateTimeField(allow_null=True)


def resend_json(delivery: EmailDelivery) -> dict[str, object]:
    return {
        "delivery_id": delivery.pk,
        "invoice_id": delivery.invoice_id,
        "key": delivery.key,
        "message_id": delivery.message_id,
        "requested_by": delivery.requested_by,
        "requested_at": delivery.created_at,
        "status": email_delivery_outcome(delivery),
        "attempts": delivery.attempts,
        "sent_at": delivery.sent_at,
    }


class RecipientCorrectionSerializer(serializers.Serializer[None]):
    # As the admin's form: an address or "" (remove the correction), and why, for the record.
    email = serializers.CharField(
        max_length=320,
        allow_blank=True,
        help_text="Send this invoice's emails here from now on; empty: remove the correction "
        "and use the provider's address again. Checked by the send's own rules.",
    )
    reason = serializers.CharField(
        max_length=500, help_text="Why, for the record (a ticket, who asked)."
    )


class RecipientSerializer(serializers.Serializer[None]):
    id = serializers.IntegerField()
    customer_email = serializers.CharField(help_text="The provider's address.")
    recipient_override = serializers.CharField(help_text="The correction; empty if none.")
    recipient = serializers.CharField(help_text="Where the emails go now.")
    changed = serializers.BooleanField(
        help_text="False: the recipient already was what was asked (a repeat); nothing recorded."
    )
    detail = serializers.CharField()


def recipient_json(invoice: Invoice, *, changed: bool, detail: str) -> dict[str, object]:
    return {
        "id": invoice.pk,
        "customer_email": invoice.customer_email,
        "recipient_override": invoice.recipient_override,
        "recipient": invoice.recipient,
        "changed": changed,
        "detail": detail,
    }


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    required=True,
    description="Any unique string, at most 255 characters, scoped to the caller: retrying "
    "the same request with the same key returns the first request's email, as it is now, "
    "and sends nothing more (header Idempotent-Replayed: true); the same key for a different "
    "request is refused with 422; a new key sends again.",
)
DETAIL = inline_serializer("Detail", {"detail": serializers.CharField()})


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
    action_permissions = {
        "resend_email": "invoicing.resend_invoice_email",
        "correct_recipient": "invoicing.correct_invoice_recipient",
    }

    def get_queryset(self) -> QuerySet[Invoice]:
        queryset = invoices_with_email_status().order_by("-pk")
        if self.action != "list":
            return queryset
        if (status := query_filter(self.request, "status", Invoice.Status.values)) is not None:
            queryset = queryset.filter(status=status)
        if (wanted := query_filter(self.request, "email_status", EMAIL_STATUSES)) is not None:
            queryset = filter_by_email_status(queryset, wanted)
        return queryset

    @extend_schema(
        request=None,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            202: ResendSerializer,
            400: OpenApiResponse(description="Idempotency-Key missing, too long or not printable."),
            404: OpenApiResponse(description="No such invoice."),
            409: OpenApiResponse(DETAIL, description="The invoice is not paid."),
            422: OpenApiResponse(
                DETAIL, description="This Idempotency-Key was used for a different request."
            ),
        },
    )
    @action(detail=True, methods=["post"], url_path="resend-email")
    def resend_email(self, request: Request, pk: str | None = None) -> Response:
        """Send the invoice email again, deliberately: once per Idempotency-Key of the caller."""
        key = idempotency_key_from(request)
        invoice = self.get_object()
        try:
            result = invoice_email_resend_request_once(
                invoice_id=invoice.pk,
                user=request.user,
                idempotency_key=key,
                fingerprint=request_fingerprint(request, invoice_id=invoice.pk),
                request=f"{request.method} {request.path}",
            )
        except IdempotencyKeyReused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_422_UNPROCESSABLE_ENTITY)
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        response = Response(resend_json(result.delivery), status=status.HTTP_202_ACCEPTED)
        if not result.created:
            response["Idempotent-Replayed"] = "true"
        return response

    @extend_schema(
        request=RecipientCorrectionSerializer,
        responses={
            200: RecipientSerializer,
            400: OpenApiResponse(
                DETAIL,
                description="An invalid address (the service's words in detail), or a field "
                "missing, empty (reason) or too long, by its name.",
            ),
            404: OpenApiResponse(description="No such invoice."),
        },
    )
    @action(detail=True, methods=["post"], url_path="recipient")
    def correct_recipient(self, request: Request, pk: str | None = None) -> Response:
        """Send this invoice's emails to another address from now on (empty: the provider's
        again), saying why; the provider's next event does not undo it. Sends nothing. The same
        correction again changes nothing and answers ``changed: false``, so a retry is
        harmless: no Idempotency-Key."""
        invoice = self.get_object()
        given = RecipientCorrectionSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        email = given.validated_data["email"]
        try:
            invoice = invoice_recipient_correct(
                invoice_id=invoice.pk,
                email=email,
                reason=given.validated_data["reason"],
                actor=f"api:{request.user.get_username()}",
            )
        except RecipientUnchanged as exc:
            # A retry of a correction that was done: answered as done.
            invoice.refresh_from_db()
            return Response(recipient_json(invoice, changed=False, detail=str(exc)))
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        detail = (
            f"{recipient_now(invoice)}; nothing was sent: "
            "replay its dead letter or resend its email"
        )
        return Response(recipient_json(invoice, changed=True, detail=detail))
