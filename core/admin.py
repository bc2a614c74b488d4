"""Admin for the async machinery: rows that record what happened are read-only; operators act
through named actions that call the same services as the commands."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django.utils.html import format_html
from django_celery_beat.admin import PeriodicTaskAdmin as BeatPeriodicTaskAdmin
from django_celery_beat.models import PeriodicTask

from core.deadletters import dead_letter_replay
from core.locks import lock_holder
from core.models import DeadLetter, OutboxMessage, ScheduledJob
from core.outbox import outbox_republish


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReplayStateFilter(admin.SimpleListFilter):
    title = "replay state"
    parameter_name = "replayed"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", "Waiting"), ("yes", "Replayed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "no":
            return queryset.filter(replayed_at__isnull=True)
        if self.value() == "yes":
            return queryset.filter(replayed_at__isnull=False)
        return queryset


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "task",
        "args",
        "reason",
        "attempts",
        "exception_class",
        "created_at",
        "replayed_at",
    )
    list_filter = ("reason", ReplayStateFilter, "task")
    search_fields = ("task_id", "exception_message")
    date_hierarchy = "created_at"
    actions = ["replay_selected"]
    fields = (
        "task",
        "task_id",
        "args",
        "kwargs",
        "queue",
        "reason",
        "attempts",
        "exception_class",
        "exception_message",
        "traceback_display",
        "first_failed_at",
        "last_failed_at",
        "created_at",
        "replayed_at",
        "replayed_by",
        "replay_outbox",
    )
    readonly_fields = fields

    @admin.display(description="Traceback")
    def traceback_display(self, obj: DeadLetter) -> str:
        return format_html('<pre style="white-space: pre-wrap">{}</pre>', obj.traceback)

    @admin.action(description="Replay selected dead letters")
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> None:
        result = dead_letter_replay(
            ids=list(queryset.values_list("pk", flat=True)),
            actor=f"admin:{request.user.get_username()}",
        )
        self.message_user(
            request, f"Replayed {len(result.replayed)} dead letter(s).", messages.SUCCESS
        )
        if result.skipped:
            self.message_user(
                request, f"Skipped {len(result.skipped)} already replayed.", messages.WARNING
            )


class PublishedFilter(admin.SimpleListFilter):
    title = "published"
    parameter_name = "published"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", "Unpublished"), ("yes", "Published")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "no":
            return queryset.filter(published_at__isnull=True)
        if self.value() == "yes":
            return queryset.filter(published_at__isnull=False)
        return queryset


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "task",
        "args",
        "queue",
        "created_at",
        "published",
        "published_at",
        "publish_attempts",
        "last_error_short",
    )
    list_filter = (PublishedFilter, "queue", "task")
    search_fields = ("task",)
    actions = ["republish_selected"]
    readonly_fields = (
        "task",
        "args",
        "kwargs",
        "queue",
        "created_at",
        "published_at",
        "publish_attempts",
        "last_error",
    )

    @admin.display(description="Published", boolean=True, ordering="published_at")
    def published(self, obj: OutboxMessage) -> bool:
        return obj.published_at is not None

    @admin.display(description="Last error")
    def last_error_short(self, obj: OutboxMessage) -> str:
        return obj.last_error[:80]

    @admin.action(description="Republish selected outbox messages")
    def republish_selected(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        ids = list(queryset.values_list("pk", flat=True))
        count = outbox_republish(ids=ids)
        self.message_user(request, f"Republished {count} outbox message(s).", messages.SUCCESS)
        if count < len(ids):
            self.message_user(
                request,
                f"Not republished: {len(ids) - count} (another publisher holds them, or the "
                "broker failed; see Last error: the relay publishes those).",
                messages.WARNING,
            )


@admin.register(ScheduledJob)
class ScheduledJobAdmin(ReadOnlyAdmin):
    """Beside django-celery-beat's "Periodic tasks": what each job did, and who runs it now."""

    list_display = (
        "name",
        "last_started_at",
        "last_finished_at",
        "last_skipped_at",
        "runs",
        "skips",
        "running_now",
        "last_holder",
        "last_error_short",
    )
    readonly_fields = (
        "name",
        "runs",
        "skips",
        "last_started_at",
        "last_finished_at",
        "last_skipped_at",
        "last_holder",
        "running_now",
        "last_result",
        "last_error",
    )

    @admin.display(description="Lock held by")
    def running_now(self, obj: ScheduledJob) -> str:
        return str(lock_holder(f"job:{obj.name}") or "-")

    @admin.display(description="Last error")
    def last_error_short(self, obj: ScheduledJob) -> str:
        return obj.last_error[:80]


# django-celery-beat's "Periodic tasks" page, where an operator looks for the jobs, shows what
# each job last did (core.ScheduledJob, by name) and who holds its lock now.
admin.site.unregister(PeriodicTask)


@admin.register(PeriodicTask)
class PeriodicTaskAdmin(BeatPeriodicTaskAdmin):
    job_fields = ("job_last_run", "job_last_skip", "job_lock_holder", "job_last_error")
    list_display = (*BeatPeriodicTaskAdmin.list_display, *job_fields[:3])
    readonly_fields = (*BeatPeriodicTaskAdmin.readonly_fields, *job_fields)
    fieldsets = (
        *BeatPeriodicTaskAdmin.fieldsets,
        ("Runs (scheduled jobs)", {"fields": job_fields, "classes": ("extrapretty", "wide")}),
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        job = ScheduledJob.objects.filter(name=OuterRef("name"))
        return (
            super()
            .get_queryset(request)
            .annotate(
                job_started_at=Subquery(job.values("last_started_at")[:1]),
                job_skipped_at=Subquery(job.values("last_skipped_at")[:1]),
                job_error=Subquery(job.values("last_error")[:1]),
            )
        )

    @admin.display(description="Job last ran", ordering="job_started_at")
    def job_last_run(self, obj: PeriodicTask) -> Any:
        return getattr(obj, "job_started_at", None)

    @admin.display(description="Job last skipped", ordering="job_skipped_at")
    def job_last_skip(self, obj: PeriodicTask) -> Any:
        return getattr(obj, "job_skipped_at", None)

    @admin.display(description="Lock held by")
    def job_lock_holder(self, obj: PeriodicTask) -> str:
        return str(lock_holder(f"job:{obj.name}") or "-")

    @admin.display(description="Job's last error")
    def job_last_error(self, obj: PeriodicTask) -> str:
        return getattr(obj, "job_error", None) or "-"
