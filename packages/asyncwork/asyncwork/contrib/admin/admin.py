"""The machinery's pages in the admin: rows that record what happened are read-only; operators
act through actions that call the same services as the commands, each declaring the power it
needs and announced as an operator action (``asyncwork.audit``). Built on ``options``, as an
application's own admin is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import OperationalError
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from asyncwork.backend import republish
from asyncwork.contrib.admin.options import ReadOnlyAdmin, admin_actor, has_power
from asyncwork.db import bounded, statement_timed_out
from asyncwork.deadletters import (
    BULK_LIMIT,
    OUTCOME_DEAD_LETTERED,
    WAITING,
    ReplayOutcome,
    ReplayResult,
    Subject,
    age,
    failure,
    refusals,
    replay,
    replay_outcomes,
    replay_state,
    resolve,
    selection,
    subjects,
    unresolve,
)
from asyncwork.models import DeadLetter, Job, job_arguments
from asyncwork.settings import asyncwork_settings

# The admin's index links the operator's dashboard (asyncwork.contrib.monitoring.dashboard).
admin.site.index_template = "admin/asyncwork/site_index.html"


class ReplayStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "replayed"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", "Waiting"), ("yes", "Replayed"), ("resolved", "Resolved")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "no":
            return queryset.filter(WAITING)
        if self.value() == "yes":
            return queryset.filter(replayed_at__isnull=False)
        if self.value() == "resolved":
            return queryset.filter(replayed_at__isnull=True, resolved_at__isnull=False)
        return queryset


# Set on each dead letter of a change list page by ``DeadLetterChangeList``.
_SUBJECT = "_described_subject"
_OUTCOME = "_replay_outcome"


class DeadLetterChangeList(ChangeList):
    """Describes the page's dead letters, and what became of the replayed ones' jobs, at once:
    one query per kind of job, and two for the replays, not per row."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        described = subjects(self.result_list)
        outcomes = replay_outcomes(self.result_list)
        for letter in self.result_list:
            setattr(letter, _SUBJECT, described.get(letter.pk))
            setattr(letter, _OUTCOME, outcomes.get(letter.pk))


def _subject(letter: DeadLetter) -> Subject | None:
    if not hasattr(letter, _SUBJECT):  # a single dead letter's page
        setattr(letter, _SUBJECT, subjects([letter]).get(letter.pk))
    subject: Subject | None = getattr(letter, _SUBJECT)
    return subject


def _outcome(letter: DeadLetter) -> ReplayOutcome | None:
    if not hasattr(letter, _OUTCOME):  # a single dead letter's page
        setattr(letter, _OUTCOME, replay_outcomes([letter]).get(letter.pk))
    outcome: ReplayOutcome | None = getattr(letter, _OUTCOME)
    return outcome


CONFIRMATION = "admin/asyncwork/deadletter/action_confirmation.html"

# An action of DeadLetterAdmin on the dead letters ticked, or with "select all" every one the
# list's filters show, on every page.
DeadLetterAction = Callable[[Any, HttpRequest, QuerySet[DeadLetter]], TemplateResponse | None]


def bulk_action(command: str) -> Callable[[DeadLetterAction], DeadLetterAction]:
    """The action acts on at most ``BULK_LIMIT`` dead letters, in one transaction whose statements
    give up after ``BULK_STATEMENT_TIMEOUT_SECONDS`` (``asyncwork.deadletters.BULK_LIMIT`` says
    why): a larger selection is a message pointing to ``command``, a statement that waits too long
    one saying nothing was done."""

    def decorate(act: DeadLetterAction) -> DeadLetterAction:
        @functools.wraps(act)
        def bounded_act(
            model_admin: Any, request: HttpRequest, queryset: QuerySet[DeadLetter]
        ) -> TemplateResponse | None:
            seconds = asyncwork_settings.BULK_STATEMENT_TIMEOUT_SECONDS
            try:
                with bounded(seconds):
                    selected = queryset.count()
                    if selected > BULK_LIMIT:
                        model_admin.message_user(
                            request,
                            f"Nothing done: {selected} dead letters selected, and the admin acts "
                            f"on at most {BULK_LIMIT} at once. Narrow the list with its filters, "
                            f"or from a terminal, for any number a batch at a time: {command}",
                            messages.ERROR,
                        )
                        return None
                    return act(model_admin, request, queryset)
            except OperationalError as exc:
                if not statement_timed_out(exc):
                    raise
                model_admin.message_user(
                    request,
                    f"Nothing done: a database statement took longer than {seconds:g} s (dead "
                    "letters another action holds, or a slow database). Try again.",
                    messages.ERROR,
                )
                return None

        return bounded_act

    return decorate


@admin.display(description="State", ordering="replayed_at")
def replayed_at(letter: DeadLetter) -> str:
    """The state column in words: waiting, replayed or resolved. A function, not a method, so
    its column keeps the class ``field-replayed_at`` (a method would lose to the model's field)."""
    return replay_state(letter)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    """What failed (its subject, linked), why in words, how often, how long ago, whether replayed;
    a dead letter's page adds a Replay button and the folded traceback."""

    list_display = (
        "id",
        "subject_link",
        "recipient",
        "failure",
        "reason",
        "attempts",
        "age",
        replayed_at,
        "outcome",
    )
    list_display_links = ("id",)
    list_select_related = ("replay_job",)  # what became of a replay, read with the page
    list_filter = ("reason", ReplayStateFilter, "task")
    search_fields = ("task_id", "exception_message", "replayed_by", "resolved_by", "resolved_why")
    date_hierarchy = "created_at"
    actions = ["replay_selected", "resolve_selected", "unresolve_selected"]
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "subject_link",
                    "recipient",
                    "failure",
                    "reason",
                    "attempts",
                    "age",
                    "replay_state",
                    "outcome",
                )
            },
        ),
        (
            "The job",
            {
                "fields": (
                    "task",
                    "task_id",
                    "args",
                    "kwargs",
                    "queue",
                    "first_failed_at",
                    "last_failed_at",
                    "created_at",
                    "replay_job",
                )
            },
        ),
        (
            "The exception",
            {"fields": ("exception_class", "exception_message", "traceback_display")},
        ),
    )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return DeadLetterChangeList

    @admin.display(description="Subject")
    def subject_link(self, obj: DeadLetter) -> str:
        subject = _subject(obj)
        if subject is None:
            return f"{obj.task}({job_arguments(obj.args)})"
        if subject.url:
            return format_html('<a href="{}">{}</a>', subject.url, str(subject))
        return str(subject)

    @admin.display(description="Recipient")
    def recipient(self, obj: DeadLetter) -> str:
        subject = _subject(obj)
        return (subject.recipient if subject else "") or "-"

    @admin.display(description="Failure")
    def failure(self, obj: DeadLetter) -> str:
        return failure(obj)

    @admin.display(description="Age", ordering="created_at")
    def age(self, obj: DeadLetter) -> str:
        return age(obj)

    @admin.display(description="Replay")
    def replay_state(self, obj: DeadLetter) -> str:
        return replay_state(obj)

    @admin.display(description="Outcome")
    def outcome(self, obj: DeadLetter) -> str:
        """What became of the job: its replay's fate, as the machinery knows it (the dead letter
        it became, linked), and the work's, as its app says."""
        parts: list[tuple[str, str]] = []
        replay = _outcome(obj)
        if replay is not None and replay.state == OUTCOME_DEAD_LETTERED and replay.again:
            link = reverse("admin:asyncwork_deadletter_change", args=[replay.again.pk])
            parts.append(
                (
                    "replay-outcome",
                    format_html(
                        'dead-lettered again as <a href="{}">dead letter #{}</a>',
                        link,
                        replay.again.pk,
                    ),
                )
            )
        elif replay is not None:
            parts.append(("replay-outcome", replay.text))
        subject = _subject(obj)
        if subject is not None and subject.outcome:
            parts.append(("subject-outcome", f"{subject.kind}: {subject.outcome}"))
        if not parts:
            return "-"
        return format_html_join("; ", '<span class="{}">{}</span>', parts)

    @admin.display(description="Traceback")
    def traceback_display(self, obj: DeadLetter) -> str:
        if not obj.traceback:
            return "-"
        # Folded: the failure in words above is what an operator reads first.
        return format_html(
            '<details class="traceback"><summary>Traceback ({} lines)</summary>'
            '<pre style="white-space: pre-wrap">{}</pre></details>',
            len(obj.traceback.splitlines()),
            obj.traceback,
        )

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return has_power(request, DeadLetter, "replay_deadletter")

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own URLs, whose "<object_id>/" would otherwise take it.
        return [
            path(
                "<path:object_id>/replay/",
                self.admin_site.admin_view(require_POST(self.replay_view)),
                name="asyncwork_deadletter_replay",
            ),
            *super().get_urls(),
        ]

    def replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The page's Replay button: the same service as the action, for this dead letter. When
        its replay check refuses it, a page saying why first, with Replay anyway."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        letter = self.get_object(request, unquote(object_id))
        if letter is None:
            raise Http404(f"no dead letter with id {object_id}")
        force = "force" in request.POST
        if not force and refusals(selection().filter(pk=letter.pk)):
            return self._confirmation(
                request,
                "replay_selected",
                [letter],
                form_url=reverse("admin:asyncwork_deadletter_replay", args=[letter.pk]),
            )
        result = replay(ids=[letter.pk], actor=admin_actor(request), force=force)
        if letter.pk in result.forced:
            self.message_user(
                request,
                f"Replayed dead letter {letter.pk} by force: its job is queued again, although "
                f"its check said: {result.forced[letter.pk]}",
                messages.WARNING,
            )
        elif letter.pk in result.replayed:
            self.message_user(
                request,
                f"Replayed dead letter {letter.pk}: its job is queued again.",
                messages.SUCCESS,
            )
        elif letter.pk in result.refused:
            self.message_user(
                request,
                f"Dead letter {letter.pk} was not replayed: {result.refused[letter.pk]}",
                messages.WARNING,
            )
        else:
            letter.refresh_from_db()
            self.message_user(
                request,
                f"Dead letter {letter.pk} was already {replay_state(letter)}; nothing done.",
                messages.WARNING,
            )
        return HttpResponseRedirect(reverse("admin:asyncwork_deadletter_change", args=[letter.pk]))

    def _confirmation(
        self,
        request: HttpRequest,
        action: str,
        letters: list[DeadLetter],
        *,
        form_url: str = "",
    ) -> TemplateResponse:
        """The page an action shows first: how many, which, and what will happen to them (a
        replay's refusals, each with why); the action runs when it is submitted. ``form_url``:
        where it is submitted, if not to the list."""
        waiting = list(selection().filter(pk__in=[letter.pk for letter in letters]))
        verb = {"replay_selected": "Replay", "resolve_selected": "Resolve"}.get(action, "Unresolve")
        refused = refusals(waiting) if action == "replay_selected" else {}
        resolved = sum(1 for letter in letters if letter.resolved_at is not None)
        return TemplateResponse(
            request,
            CONFIRMATION,
            {
                **self.admin_site.each_context(request),
                "title": f"{verb} {len(letters)} dead letter(s)?",
                "opts": self.model._meta,
                "action": action,
                "verb": verb,
                "letters": letters,
                "count": len(letters),
                # What acting changes: the waiting ones, or for unresolve the resolved ones.
                "acted_on": resolved if action == "unresolve_selected" else len(waiting),
                "refused": [
                    {"letter": letter, "why": refused[letter.pk]}
                    for letter in waiting
                    if letter.pk in refused
                ],
                "unrefused": len(waiting) - len(refused),
                "form_url": form_url,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "media": self.media,
            },
        )

    @admin.action(description="Replay selected dead letters…", permissions=["replay"])
    @bulk_action("manage.py dlq replay --reason R --task T --since S --until U (or --all)")
    def replay_selected(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> TemplateResponse | None:
        """A page first, with the count and the refusals of their replay check, each with why;
        replaying on its submit: Replay leaves the refused ones, Replay anyway forces them."""
        force = "force" in request.POST
        if "confirm" not in request.POST and not force:
            return self._confirmation(request, "replay_selected", list(queryset.order_by("pk")))
        result = replay(
            ids=list(queryset.values_list("pk", flat=True)), actor=admin_actor(request), force=force
        )
        self._replay_reported(request, result)
        return None

    def _replay_reported(self, request: HttpRequest, result: ReplayResult) -> None:
        self.message_user(
            request, f"Replayed {len(result.replayed)} dead letter(s).", messages.SUCCESS
        )
        if result.forced:
            self.message_user(
                request,
                f"Replayed by force, past their check: {_listed(result.forced)}",
                messages.WARNING,
            )
        if result.refused:
            self.message_user(
                request,
                f"Not replayed, {len(result.refused)} refused by their check (correct what it "
                f"names, or replay anyway): {_listed(result.refused)}",
                messages.WARNING,
            )
        if result.skipped:
            self.message_user(
                request, f"Skipped {len(result.skipped)} already replayed.", messages.WARNING
            )
        if result.resolved:
            self.message_user(
                request,
                f"Skipped {len(result.resolved)} resolved: unresolve one to replay it.",
                messages.WARNING,
            )

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return has_power(request, DeadLetter, "resolve_deadletter")

    @admin.action(description="Resolve selected dead letters…", permissions=["resolve"])
    @bulk_action("manage.py dlq resolve --reason R --task T --since S --until U --why TEXT")
    def resolve_selected(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> TemplateResponse | None:
        """A page first, with the count and a box for why; resolving on its submit."""
        why = request.POST.get("why", "").strip()
        if "confirm" not in request.POST or not why:
            return self._confirmation(request, "resolve_selected", list(queryset.order_by("pk")))
        result = resolve(
            ids=list(queryset.values_list("pk", flat=True)), actor=admin_actor(request), why=why
        )
        self.message_user(
            request, f"Resolved {len(result.changed)} dead letter(s).", messages.SUCCESS
        )
        if result.skipped:
            self.message_user(
                request,
                f"Skipped {len(result.skipped)} replayed or resolved before.",
                messages.WARNING,
            )
        return None

    @admin.action(description="Unresolve selected dead letters…", permissions=["resolve"])
    @bulk_action("manage.py dlq unresolve ID [ID ...]")
    def unresolve_selected(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> TemplateResponse | None:
        """A page first, with the count; unresolving on its submit."""
        if "confirm" not in request.POST:
            return self._confirmation(request, "unresolve_selected", list(queryset.order_by("pk")))
        result = unresolve(
            ids=list(queryset.values_list("pk", flat=True)), actor=admin_actor(request)
        )
        self.message_user(
            request, f"{len(result.changed)} dead letter(s) wait again.", messages.SUCCESS
        )
        if result.skipped:
            self.message_user(
                request, f"Skipped {len(result.skipped)} not resolved.", messages.WARNING
            )
        return None


def _listed(whys: dict[int, str]) -> str:
    return "; ".join(f"#{pk}: {why}" for pk, why in sorted(whys.items()))


@admin.display(description="Last error")
def last_error_short(row: Job) -> str:
    return row.last_error[:80]


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """Every enqueued task and what became of it; a job whose message the broker lost can be
    published again."""

    list_display = (
        "id",
        "task",
        "args",
        "queue",
        "status",
        "attempts",
        "created_at",
        "due_at",
        "published_at",
        "finished_at",
        last_error_short,
    )
    list_filter = ("status", "queue", "task")
    search_fields = ("task",)
    date_hierarchy = "created_at"
    actions = ["republish_selected"]
    readonly_fields = [f.name for f in Job._meta.fields]

    def has_republish_permission(self, request: HttpRequest) -> bool:
        return has_power(request, Job, "republish_job")

    @admin.action(description="Publish selected jobs again", permissions=["republish"])
    def republish_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        count = republish(ids=ids, actor=admin_actor(request))
        self.message_user(request, f"Published {count} job(s) again.", messages.SUCCESS)
        if count < len(ids):
            self.message_user(
                request,
                f"Not published: {len(ids) - count} (started or done, held by another "
                "publisher, or the broker failed: see Last error; the relay publishes those).",
                messages.WARNING,
            )
