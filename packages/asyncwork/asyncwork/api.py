"""REST API for dead letters, staff only: list, read, replay (the ``asyncwork.replay_deadletter``
power), resolve and unresolve (``asyncwork.resolve_deadletter``), each the admin's service; the
powers are checked by ``asyncwork.permissions``, for staff only, whatever the project's default
permissions.
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
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from asyncwork.deadletters import (
    dead_letter_failure,
    dead_letter_replay,
    dead_letter_resolve,
    dead_letter_subjects,
    dead_letter_unresolve,
)
from asyncwork.models import DeadLetter
from asyncwork.permissions import ModelPermissionsWithPowers

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
            "resolved_at",
            "resolved_by",
            "resolved_why",
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


ResolveResponse = inline_serializer(
    "ResolveResponse",
    {
        "id": serializers.IntegerField(),
        "changed": serializers.BooleanField(),
        "detail": serializers.CharField(),
    },
)


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("reason", OpenApiTypes.STR, enum=list(DeadLetter.Reason.values)),
            OpenApiParameter("replayed", OpenApiTypes.BOOL),
            OpenApiParameter("resolved", OpenApiTypes.BOOL),
        ]
    )
)
class DeadLetterViewSet(viewsets.ReadOnlyModelViewSet[DeadLetter]):
    serializer_class = DeadLetterSerializer
    # Staff, then what their permissions allow, whatever the project's default permissions.
    permission_classes = [IsAdminUser, ModelPermissionsWithPowers]
    action_permissions = {
        "replay": "asyncwork.replay_deadletter",
        "resolve": "asyncwork.resolve_deadletter",
        "unresolve": "asyncwork.resolve_deadletter",
    }

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
        resolved = self.request.query_params.get("resolved")
        if resolved is not None:
            if resolved not in {"true", "false"}:
                raise ValidationError({"resolved": "true or false"})
            queryset = queryset.filter(resolved_at__isnull=resolved == "false")
        return queryset

    @extend_schema(request=None, responses={200: ReplayResponse})
    @action(detail=True, methods=["post"])
    def replay(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        result = dead_letter_replay(ids=[letter.pk], actor=f"api:{request.user.get_username()}")
        replayed = letter.pk in result.replayed
        if replayed:
            detail = "replayed"
        elif letter.pk in result.resolved:
            detail = "resolved; unresolve it to replay it"
        else:
            detail = "already replayed; nothing done"
        return Response({"id": letter.pk, "replayed": replayed, "detail": detail})

    @extend_schema(
        request=inline_serializer("ResolveRequest", {"why": serializers.CharField()}),
        responses={200: ResolveResponse},
    )
    @action(detail=True, methods=["post"])
    def resolve(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        why = request.data.get("why") if hasattr(request.data, "get") else None
        if not isinstance(why, str) or not why.strip():
            raise ValidationError({"why": "say why the job will not be run"})
        result = dead_letter_resolve(
            ids=[letter.pk], actor=f"api:{request.user.get_username()}", why=why
        )
        changed = letter.pk in result.changed
        detail = "resolved" if changed else "replayed or resolved before; nothing done"
        return Response({"id": letter.pk, "changed": changed, "detail": detail})

    @extend_schema(request=None, responses={200: ResolveResponse})
    @action(detail=True, methods=["post"])
    def unresolve(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        result = dead_letter_unresolve(ids=[letter.pk], actor=f"api:{request.user.get_username()}")
        changed = letter.pk in result.changed
        detail = "waits again" if changed else "was not resolved; nothing done"
        return Response({"id": letter.pk, "changed": changed, "detail": detail})
