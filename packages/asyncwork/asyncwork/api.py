"""REST API for dead letters, staff only: list, read, replay (which needs the
``asyncwork.replay_deadletter`` power, ``operators.permissions``, and is the admin's service).
Each dead letter says what it was about (``subject``, null when its app does not say) and why it
failed (``failure``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from asyncwork.deadletters import dead_letter_failure, dead_letter_replay, dead_letter_subjects
from asyncwork.models import DeadLetter

SubjectSchema = inline_serializer(
    "Subject",
    {
        "kind": serializers.CharField(help_text='What it is, e.g. "invoice".'),
        "label": serializers.CharField(help_text="Which one, e.g. the invoice's number."),
        "recipient": serializers.CharField(help_text="Who it was for; empty if nobody."),
        "url": serializers.CharField(help_text="Its page in the admin; empty if none."),
    },
    allow_null=True,
)


class DeadLetterSerializer(serializers.ModelSerializer[DeadLetter]):
    subject = serializers.SerializerMethodField()
    failure = serializers.SerializerMethodField()

    @extend_schema_field(SubjectSchema)
    def get_subject(self, letter: DeadLetter) -> dict[str, Any] | None:
        subjects = self.context.get("subjects")
        if subjects is None:  # not given by the view: this one alone
            subjects = dead_letter_subjects([letter])
        subject = subjects.get(letter.pk)
        return None if subject is None else dataclasses.asdict(subject)

    @extend_schema_field(OpenApiTypes.STR)
    def get_failure(self, letter: DeadLetter) -> str:
        return dead_letter_failure(letter)

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
            "subject",
            "failure",
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
    action_permissions = {"replay": "asyncwork.replay_deadletter"}

    def get_serializer(self, *args: Any, **kwargs: Any) -> Any:
        # The subjects of everything serialised at once: a page of a list, or the one row.
        if args and "context" not in kwargs:
            letters = list(args[0]) if kwargs.get("many") else [args[0]]
            kwargs["context"] = {
                **self.get_serializer_context(),
                "subjects": dead_letter_subjects(letters),
            }
        return super().get_serializer(*args, **kwargs)

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
