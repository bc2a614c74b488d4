"""The scheduled jobs in the admin: what each did and who runs it now, beside django-celery-beat's
"Periodic tasks", which gain the same columns. Read-only, as every row that records what
happened."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest
from django_celery_beat.admin import PeriodicTaskAdmin as BeatPeriodicTaskAdmin
from django_celery_beat.models import PeriodicTask

from asyncwork.contrib.admin.options import ReadOnlyAdmin
from asyncwork.contrib.periodic.locks import lock_holder
from asyncwork.models import ScheduledJob


@admin.display(description="Last error")
def last_error_short(row: ScheduledJob) -> str:
    return row.last_error[:80]


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
        last_error_short,
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


# django-celery-beat's "Periodic tasks" page also shows what each job last did and who holds its
# lock.
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

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # django-celery-beat's own actions declare no permission yet change a schedule or start a
        # job: they need the change permission here.
        actions = super().get_actions(request)
        if self.has_change_permission(request):
            return actions
        return {
            name: action
            for name, action in actions.items()
            if hasattr(action[0], "allowed_permissions")
        }

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
