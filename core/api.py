"""REST API for dead letters (staff only): list, read, replay. Reading needs the view
permission and replaying the ``core.replay_deadletter`` power too (``core.permissions``).
Replay calls the same service as the admin action and ``manage.py dlq replay``, which records
it as an operator action."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from core.deadletters import dead_letter_replay
from core.models import DeadLetter


class DeadLetterSerializer(serializers.ModelSerializer[DeadLetter]):
    class Meta:
        model = DeadLetter
        fields = (
            "id",
            "task",
            "task_id",
            "args",
            "kwargs",
            "reason",
            "exception_class",
            "exception_message",
            "traceback",
            "attempts",
            "first_failed_at",
            "last_failed_at",
            "created_at",
            "replayed_at",
            "replayed_by",
        )
        read_only_fields = fields


ReplayResponse = inline_serializer(
    "ReplayResponse",
    {
        "id": serializers.IntegerField(),
        "replayed": serializers.BooleanField(),
        "detail": serializers.CharField(),
    },
)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("reason", OpenApiTypes.STR, enum=list(DeadLetter.Reason.values)),
            OpenApiParameter("replayed", OpenApiTypes.BOOL),
        ]
    )
)
class DeadLetterViewSet(viewsets.ReadOnlyModelViewSet[DeadLetter]):
    serializer_class = DeadLetterSerializer
    action_permissions = {"replay": "core.replay_deadletter"}

    def get_queryset(self) -> QuerySet[DeadLetter]:
        queryset = DeadLetter.objects.order_by("-pk")
        if self.action != "list":
            return queryset
        reason = self.request.query_params.get("reason")
        if reason is not None:
            if reason not in DeadLetter.Reason.values:
                raise ValidationError({"reason": f"one of {', '.join(DeadLetter.Reason.values)}"})
            queryset = queryset.filter(reason=reason)
        replayed = self.request.query_params.get("replayed")
        if replayed is not None:
            if replayed not in {"true", "false"}:
                raise ValidationError({"replayed": "true or false"})
            queryset = queryset.filter(replayed_at__isnull=replayed == "false")
        return queryset

    @extend_schema(request=None, responses={200: ReplayResponse})
    @action(detail=True, methods=["post"])
    def replay(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        result = dead_letter_replay(ids=[letter.pk], actor=f"api:{request.user.get_username()}")
        replayed = letter.pk in result.replayed
        return Response(
            {
                "id": letter.pk,
                "replayed": replayed,
                "detail": "replayed" if replayed else "already replayed; nothing done",
            }
        )
