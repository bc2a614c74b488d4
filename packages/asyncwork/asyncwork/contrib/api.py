"""REST API for dead letters, staff only: list, read, replay (the ``asyncwork.replay_deadletter``
power), resolve and unresolve (``asyncwork.resolve_deadletter``), each the admin's service; the
powers are checked by ``asyncwork.contrib.permissions``, for staff only, whatever the project's
default
permissions. ``bulk`` replays or resolves many at once, chosen by id or by the filters of
``selection``, once per ``Idempotency-Key``; its dry run needs the view permission only.
A bulk request acts on at most ``BULK_LIMIT`` dead letters, in one transaction whose statements
give up after ``BULK_STATEMENT_TIMEOUT_SECONDS``: more is a 413 naming the ``manage.py dlq``
command that does it, a statement that waits too long a 503, and either does nothing. Each dead
letter says what it was about (``subject``, null when its app does not say) and why it failed
(``failure``). A replay its task's replay check refuses is a 409 unless forced.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

from django.db import OperationalError
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response

from asyncwork.contrib.idempotency import (
    HEADER,
    IdempotencyKeyReused,
    idempotency_key_from,
    idempotent_respond,
    request_fingerprint,
)
from asyncwork.contrib.permissions import ModelPermissionsWithPowers
from asyncwork.db import bounded, statement_timed_out
from asyncwork.deadletters import (
    BULK_LIMIT,
    WAITING,
    SelectionInvalid,
    failure,
    refusals,
    replay,
    resolve,
    selection,
    subjects,
    unresolve,
)
from asyncwork.models import DeadLetter
from asyncwork.settings import asyncwork_settings


def query_filter(request: Request, name: str, choices: Sequence[str]) -> str | None:
    """A list's filter ``name`` from the query string: one of ``choices``, or None when not
    given; any other value is a 400 naming the choices."""
    value = request.query_params.get(name)
    if value is not None and value not in choices:
        raise ValidationError({name: f"one of {', '.join(choices)}"})
    return value


SubjectSchema = inline_serializer(
    "Subject",
    {
        "kind": serializers.CharField(help_text='What it is, e.g. "invoice".'),
        "label": serializers.CharField(help_text="Which one, e.g. the invoice's number."),
        "recipient": serializers.CharField(help_text="Who it was for; empty if nobody."),
        "url": serializers.CharField(help_text="Its page in the admin; empty if none."),
        "outcome": serializers.CharField(
            help_text="What became of the job's work now, in words; empty if its app does not say."
        ),
    },
    allow_null=True,
)


class DeadLetterSerializer(serializers.ModelSerializer[DeadLetter]):
    subject = serializers.SerializerMethodField()
    failure = serializers.SerializerMethodField()

    @extend_schema_field(SubjectSchema)
    def get_subject(self, letter: DeadLetter) -> dict[str, Any] | None:
        described = self.context.get("subjects")
        if described is None:  # not given by the view: this one alone
            described = subjects([letter])
        subject = described.get(letter.pk)
        return None if subject is None else dataclasses.asdict(subject)

    @extend_schema_field(OpenApiTypes.STR)
    def get_failure(self, letter: DeadLetter) -> str:
        return failure(letter)

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
RefusedResponse = inline_serializer(
    "ReplayRefusedResponse",
    {
        "id": serializers.IntegerField(),
        "replayed": serializers.BooleanField(),
        "detail": serializers.CharField(),
        "refused": serializers.CharField(help_text="Why the replay would only fail again."),
    },
)


class ReplayRequest(serializers.Serializer[None]):
    force = serializers.BooleanField(
        default=False,
        help_text="Replay it even though its replay check says it would only fail again.",
    )


FILTERS = ("reason", "task", "since", "until")
TIME_HELP = (
    "ISO 8601 date or date and time (2026-12-03, 2026-12-03T17:00Z); without an offset, the "
    "server's time zone."
)


class BulkRequest(serializers.Serializer[None]):
    action = serializers.ChoiceField(choices=("replay", "resolve"))
    ids = serializers.ListField(
        child=serializers.IntegerField(min_value=1),
        required=False,
        allow_empty=False,
        help_text="These dead letters, instead of filters.",
    )
    all = serializers.BooleanField(
        default=False, help_text="Replay every dead letter still waiting (replay only)."
    )
    reason = serializers.CharField(
        required=False,
        help_text=f"Those still waiting of this reason: {', '.join(DeadLetter.Reason.values)}.",
    )
    task = serializers.CharField(required=False, help_text="Those still waiting of this task.")
    since = serializers.CharField(
        required=False, help_text=f"Those still waiting created at or after this: {TIME_HELP}"
    )
    until = serializers.CharField(
        required=False,
        help_text=f"Those still waiting created before this (a date: its end): {TIME_HELP}",
    )
    why = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=500,
        help_text="Why the jobs will not be run (resolve: required unless dry_run).",
    )
    dry_run = serializers.BooleanField(
        default=False, help_text="Say what would be done; do nothing, record nothing."
    )
    force = serializers.BooleanField(
        default=False, help_text="Replay those their replay check refuses too (replay only)."
    )

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        filters = {name: data[name] for name in FILTERS if name in data}
        if "ids" in data and (filters or data["all"]):
            raise ValidationError(
                {"ids": "give ids, or filters (reason, task, since, until), or all: one of them"}
            )
        if data["all"] and filters:
            raise ValidationError({"all": "all is every dead letter still waiting: no filters"})
        if not ("ids" in data or filters or data["all"]):
            raise ValidationError(
                {
                    "ids": "say which dead letters: ids, filters (reason, task, since, until), "
                    "or all: true (replay)"
                }
            )
        if data["action"] == "resolve":
            if data["all"]:
                raise ValidationError({"all": "resolve takes ids or filters"})
            if data["force"]:
                raise ValidationError({"force": "only with action replay"})
            if not data["dry_run"] and not data.get("why", "").strip():
                raise ValidationError({"why": "say why the jobs will not be run"})
        elif "why" in data:
            raise ValidationError({"why": "only with action resolve"})
        try:
            # Built now, evaluated when acting: a filter it cannot read is a 400 here.
            data["selection"] = selection(**filters)
        except SelectionInvalid as exc:
            raise ValidationError({exc.field: exc.message}) from None
        return data


class BulkItem(serializers.Serializer[None]):
    """One dead letter of a bulk answer, and why it went as it did."""

    id = serializers.IntegerField()
    detail = serializers.CharField()


def _items(help_text: str) -> Any:
    """A list of ``{"id", "detail"}``: which dead letters, and why each (one schema component,
    however many lists use it)."""
    return BulkItem(many=True, required=False, help_text=help_text)


BulkResponse = inline_serializer(
    "BulkResponse",
    {
        "action": serializers.ChoiceField(choices=("replay", "resolve")),
        "dry_run": serializers.BooleanField(),
        "selected": serializers.IntegerField(help_text="How many dead letters were chosen."),
        "ids": serializers.ListField(
            child=serializers.IntegerField(), required=False, help_text="Dry run: which."
        ),
        "replayed": serializers.ListField(child=serializers.IntegerField(), required=False),
        "resolved": serializers.ListField(child=serializers.IntegerField(), required=False),
        "skipped": _items("Replayed or resolved before."),
        "refused": _items(
            "Not replayed (a dry run: would not be): their replay check says why they would "
            "only fail again; force replays them."
        ),
        "forced": _items("Replayed by force past their replay check (a dry run: would be)."),
    },
)
BULK_POWERS = {"replay": "asyncwork.replay_deadletter", "resolve": "asyncwork.resolve_deadletter"}
IDEMPOTENCY_KEY = OpenApiParameter(
    HEADER,
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="Required, except for a dry run. Any unique string, at most 255 characters, "
    "scoped to the caller: the same request again under the same key answers what the first "
    "did and does nothing more (header Idempotent-Replayed: true); the same key for another "
    "request is refused with 422.",
)
DETAIL = inline_serializer("BulkDetail", {"detail": serializers.CharField()})
TOO_MANY = inline_serializer(
    "BulkTooMany",
    {
        "detail": serializers.CharField(),
        "selected": serializers.IntegerField(help_text="How many dead letters were chosen."),
        "limit": serializers.IntegerField(help_text="The most one request acts on."),
        "command": serializers.CharField(
            help_text="The manage.py command that does the same for any number, a batch at a time."
        ),
    },
)


class TooMany(Exception):
    """The request chose more dead letters than ``BULK_LIMIT``."""

    def __init__(self, selected: int) -> None:
        super().__init__(f"{selected} dead letters selected")
        self.selected = selected


def bulk_command(wanted: dict[str, Any]) -> str:
    """The ``manage.py dlq`` command line that does what a bulk request asked, for any number."""
    words = ["manage.py dlq", wanted["action"]]
    if "ids" in wanted:
        words.append("ID [ID ...]")
    elif wanted["all"]:
        words.append("--all")
    words += [f"--{name} {shlex.quote(str(wanted[name]))}" for name in FILTERS if name in wanted]
    if wanted.get("why", "").strip():
        words.append(f"--why {shlex.quote(wanted['why'].strip())}")
    words += [f"--{flag.replace('_', '-')}" for flag in ("force", "dry_run") if wanted[flag]]
    return " ".join(words)


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
        # A dry run needs the view permission only; the body's action names the power a real
        # run needs (BULK_POWERS), checked by bulk() once the body is read.
        "bulk": "asyncwork.view_deadletter",
    }

    def get_serializer(self, *args: Any, **kwargs: Any) -> Any:
        # The subjects of everything serialised at once: a page of a list, or the one row.
        if args and "context" not in kwargs:
            letters = list(args[0]) if kwargs.get("many") else [args[0]]
            kwargs["context"] = {
                **self.get_serializer_context(),
                "subjects": subjects(letters),
            }
        return super().get_serializer(*args, **kwargs)

    def get_queryset(self) -> QuerySet[DeadLetter]:
        queryset = DeadLetter.objects.order_by("-pk")
        if self.action != "list":
            return queryset
        if (reason := query_filter(self.request, "reason", DeadLetter.Reason.values)) is not None:
            queryset = queryset.filter(reason=reason)
        for name, field in (("replayed", "replayed_at"), ("resolved", "resolved_at")):
            if (given := query_filter(self.request, name, ("true", "false"))) is not None:
                queryset = queryset.filter(**{f"{field}__isnull": given == "false"})
        return queryset

    @extend_schema(
        request=ReplayRequest,
        responses={
            200: ReplayResponse,
            409: OpenApiResponse(
                RefusedResponse,
                description="Its replay check says it would only fail again; not replayed.",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def replay(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        body = ReplayRequest(data=request.data)
        body.is_valid(raise_exception=True)
        result = replay(
            ids=[letter.pk],
            actor=f"api:{request.user.get_username()}",
            force=body.validated_data["force"],
        )
        refused = result.refused.get(letter.pk)
        if refused is not None:
            detail = f"not replayed: {refused} (to replay it anyway: force)"
            answer = {"id": letter.pk, "replayed": False, "detail": detail, "refused": refused}
            return Response(answer, status=status.HTTP_409_CONFLICT)
        replayed = letter.pk in result.replayed
        if letter.pk in result.forced:
            detail = f"replayed by force, past its check: {result.forced[letter.pk]}"
        elif replayed:
            detail = "replayed"
        elif letter.pk in result.resolved:
            detail = "resolved; unresolve it to replay it"
        else:
            detail = "already replayed; nothing done"
        return Response({"id": letter.pk, "replayed": replayed, "detail": detail})

    @extend_schema(
        request=BulkRequest,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            200: BulkResponse,
            400: OpenApiResponse(
                description="A field's reason: the body, an unknown id, or the "
                "Idempotency-Key missing, too long or not printable."
            ),
            403: OpenApiResponse(DETAIL, description="No permission for the action."),
            413: OpenApiResponse(
                TOO_MANY,
                description=f"More than {BULK_LIMIT} dead letters chosen; nothing done. Choose "
                "fewer, or run the command given, which takes any number.",
            ),
            422: OpenApiResponse(
                DETAIL, description="This Idempotency-Key was used for a different request."
            ),
            503: OpenApiResponse(
                DETAIL,
                description="A statement waited past BULK_STATEMENT_TIMEOUT_SECONDS (rows held "
                "by another action); nothing done, the key unused: try again.",
            ),
        },
    )
    @action(detail=False, methods=["post"])
    def bulk(self, request: Request) -> Response:
        """Replay or resolve many dead letters: by id, or those still waiting that the filters
        select; ``dry_run`` says which without acting."""
        body = BulkRequest(data=request.data)
        body.is_valid(raise_exception=True)
        wanted = body.validated_data
        verb: str = wanted["action"]
        key = ""
        if not wanted["dry_run"]:
            power = BULK_POWERS[verb]
            if not request.user.has_perm(power):
                self.permission_denied(request, message=f"{verb} needs the {power} permission")
            key = idempotency_key_from(request)
        seconds = asyncwork_settings.BULK_STATEMENT_TIMEOUT_SECONDS
        try:
            with bounded(seconds):
                if wanted["dry_run"]:
                    return Response(self._bulk_dry_run(verb, wanted))
                done = idempotent_respond(
                    user=request.user,
                    key=key,
                    fingerprint=request_fingerprint(request),
                    request=f"{request.method} {request.path} ({verb})",
                    perform=lambda: self._bulk_perform(verb, wanted),
                )
        except TooMany as exc:
            command = bulk_command(wanted)
            detail = (
                f"{exc.selected} dead letters selected: a request acts on at most {BULK_LIMIT}. "
                "Choose fewer (ids, or narrower reason, task, since, until), or run the command, "
                f"which takes any number a batch at a time: {command}"
            )
            answer = {"detail": detail, "selected": exc.selected, "limit": BULK_LIMIT}
            return Response(
                {**answer, "command": command}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
            )
        except IdempotencyKeyReused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_422_UNPROCESSABLE_ENTITY)
        except OperationalError as exc:
            if not statement_timed_out(exc):
                raise
            detail = (
                f"a database statement took longer than {seconds:g} s (dead letters another "
                "action holds, or a slow database); nothing was done: try again"
            )
            return Response(
                {"detail": detail},
                status=status.HTTP_503_SERVICE_UNAVAILABLE,
                headers={"Retry-After": str(max(1, round(seconds)))},
            )
        response = Response(done.response)
        if done.replayed:
            response["Idempotent-Replayed"] = "true"
        return response

    def _bulk_ids(self, wanted: dict[str, Any]) -> list[int]:
        """The ids given (each must exist), or those the filters select; ``TooMany`` past
        ``BULK_LIMIT``."""
        if "ids" not in wanted:
            selection = wanted["selection"]
            ids: list[int] = list(selection.values_list("pk", flat=True)[: BULK_LIMIT + 1])
            if len(ids) > BULK_LIMIT:
                raise TooMany(selection.count())
            return ids
        ids = sorted(set(wanted["ids"]))
        if len(ids) > BULK_LIMIT:
            raise TooMany(len(ids))
        known = set(DeadLetter.objects.filter(pk__in=ids).values_list("pk", flat=True))
        unknown = [pk for pk in ids if pk not in known]
        if unknown:
            # A list, as the serializer's own field errors are.
            raise ValidationError(
                {"ids": [f"no dead letter with id {', '.join(map(str, unknown))}"]}
            )
        return ids

    def _bulk_dry_run(self, verb: str, wanted: dict[str, Any]) -> dict[str, Any]:
        ids = self._bulk_ids(wanted)
        answer: dict[str, Any] = {"action": verb, "dry_run": True, "selected": len(ids), "ids": ids}
        if verb == "replay":
            waiting = DeadLetter.objects.filter(WAITING, pk__in=ids).order_by("pk")
            refused = [{"id": pk, "detail": why} for pk, why in refusals(waiting).items()]
            answer["forced" if wanted["force"] else "refused"] = refused
        return answer

    def _bulk_perform(self, verb: str, wanted: dict[str, Any]) -> dict[str, Any]:
        ids = self._bulk_ids(wanted)
        actor = f"api:{self.request.user.get_username()}"
        answer: dict[str, Any] = {"action": verb, "dry_run": False, "selected": len(ids)}
        if verb == "resolve":
            resolved = resolve(ids=ids, actor=actor, why=wanted["why"])
            skipped = [
                {"id": pk, "detail": "replayed or resolved before"} for pk in resolved.skipped
            ]
            return {**answer, "resolved": resolved.changed, "skipped": skipped}
        result = replay(ids=ids, actor=actor, force=wanted["force"])
        skipped = [{"id": pk, "detail": "already replayed"} for pk in result.skipped] + [
            {"id": pk, "detail": "resolved; unresolve it to replay it"} for pk in result.resolved
        ]
        return {
            **answer,
            "replayed": result.replayed,
            "skipped": sorted(skipped, key=lambda item: item["id"]),
            "refused": [{"id": pk, "detail": why} for pk, why in result.refused.items()],
            "forced": [{"id": pk, "detail": why} for pk, why in result.forced.items()],
        }

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
        result = resolve(ids=[letter.pk], actor=f"api:{request.user.get_username()}", why=why)
        changed = letter.pk in result.changed
        detail = "resolved" if changed else "replayed or resolved before; nothing done"
        return Response({"id": letter.pk, "changed": changed, "detail": detail})

    @extend_schema(request=None, responses={200: ResolveResponse})
    @action(detail=True, methods=["post"])
    def unresolve(self, request: Request, pk: str | None = None) -> Response:
        letter = self.get_object()
        result = unresolve(ids=[letter.pk], actor=f"api:{request.user.get_username()}")
        changed = letter.pk in result.changed
        detail = "waits again" if changed else "was not resolved; nothing done"
        return Response({"id": letter.pk, "changed": changed, "detail": detail})
