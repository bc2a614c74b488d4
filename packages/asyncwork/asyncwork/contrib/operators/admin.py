"""The audit trail and API tokens in the admin, and the operator actions shown on the pages of
the rows they acted on (the machinery's dead letters and jobs included). Rows that
record what happened are read-only everywhere: only the acting services write them."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.contenttypes.admin import GenericTabularInline
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from knox.models import AuthToken

from asyncwork.contrib.admin.admin import DeadLetterAdmin, JobAdmin
from asyncwork.contrib.admin.options import ReadOnly, ReadOnlyAdmin, admin_actor
from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.operators.tokens import api_tokens_revoke
from asyncwork.models import DeadLetter, Job


def _json(value: Any) -> str:
    return "-" if value is None else json.dumps(value, ensure_ascii=False, sort_keys=True)


class OperatorActionInline(ReadOnly, GenericTabularInline):
    """The operator actions taken on the row the page shows, newest first."""

    model = OperatorAction
    ct_field = "target_type"
    ct_fk_field = "target_id"
    extra = 0
    can_delete = False
    verbose_name_plural = "operator actions"
    fields = ("created_at", "action", "actor", "detail", "before_json", "after_json")
    readonly_fields = fields

    @admin.display(description="Before")
    def before_json(self, obj: OperatorAction) -> str:
        return _json(obj.before)

    @admin.display(description="After")
    def after_json(self, obj: OperatorAction) -> str:
        return _json(obj.after)

    def get_queryset(self, request: HttpRequest) -> QuerySet[OperatorAction]:
        return super().get_queryset(request).order_by("-created_at", "-pk")


class ViaFilter(admin.SimpleListFilter):
    title = "via"
    parameter_name = "via"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("admin", "Admin"), ("api", "API"), ("cli", "Command line")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(actor__startswith=f"{value}:") if value else queryset


@admin.register(OperatorAction)
class OperatorActionAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "action", "actor", "target_link", "detail")
    list_filter = ("action", ViaFilter, ("target_type", admin.RelatedOnlyFieldListFilter))
    search_fields = ("actor", "target_label", "target_id", "detail")
    date_hierarchy = "created_at"
    fields = (
        "created_at",
        "action",
        "actor",
        "target_type",
        "target_id",
        "target_link",
        "detail",
        "before_pretty",
        "after_pretty",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[OperatorAction]:
        return super().get_queryset(request).select_related("target_type")

    @admin.display(description="Target", ordering="target_label")
    def target_link(self, obj: OperatorAction) -> str:
        label = obj.target_label or obj.target_id
        if obj.target_type is None:
            return label
        try:
            url = reverse(
                f"admin:{obj.target_type.app_label}_{obj.target_type.model}_change",
                args=[quote(obj.target_id)],
            )
        except NoReverseMatch:
            return label
        return format_html('<a href="{}">{}</a>', url, label)

    @admin.display(description="Before")
    def before_pretty(self, obj: OperatorAction) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.before, indent=2, ensure_ascii=False))

    @admin.display(description="After")
    def after_pretty(self, obj: OperatorAction) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.after, indent=2, ensure_ascii=False))


# knox's admin can add a token with no expiry; here tokens are only listed and revoked.
admin.site.unregister(AuthToken)


@admin.register(AuthToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("token_key", "user", "created", "expiry")
    search_fields = ("token_key", "user__username")
    fields = ("token_key", "user", "created", "expiry")
    readonly_fields = fields
    ordering = ("-created",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def delete_model(self, request: HttpRequest, obj: AuthToken) -> None:
        api_tokens_revoke(tokens=AuthToken.objects.filter(pk=obj.pk), actor=admin_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[AuthToken]) -> None:
        api_tokens_revoke(tokens=queryset, actor=admin_actor(request))


# The machinery's pages, with the operator actions taken on each row (Django's way to extend an
# installed app's admin: register a subclass in its place).
admin.site.unregister(DeadLetter)
admin.site.unregister(Job)


@admin.register(DeadLetter)
class AuditedDeadLetterAdmin(DeadLetterAdmin):
    inlines = [OperatorActionInline]


@admin.register(Job)
class AuditedJobAdmin(JobAdmin):
    inlines = [OperatorActionInline]
