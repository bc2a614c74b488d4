"""``manage.py setup_groups``: **viewers** get the view permission of every model of
``ASYNCWORK["OPERATOR_APPS"]``; **operators** those and every permission the models declare in
their ``Meta`` (the powers). Idempotent; a group changed by hand is set back, with what changed.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.contrib.auth.management import create_permissions
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.db.models import Model, Q, QuerySet

from asyncwork.settings import asyncwork_settings

VIEWERS = "viewers"
OPERATORS = "operators"


def _operator_models() -> list[type[Model]]:
    models: list[type[Model]] = []
    for label in asyncwork_settings.OPERATOR_APPS:
        try:
            app_config = apps.get_app_config(label)
        except LookupError:
            raise CommandError(
                f"ASYNCWORK['OPERATOR_APPS'] names {label!r}, which is not installed"
            ) from None
        # The permissions of a model added since the last migrate may not exist yet.
        create_permissions(app_config, verbosity=0)
        models.extend(app_config.get_models())
    return models


def group_permissions() -> dict[str, QuerySet[Permission]]:
    view, power = Q(pk__in=[]), Q(pk__in=[])
    for model, content_type in ContentType.objects.get_for_models(*_operator_models()).items():
        view |= Q(content_type=content_type, codename=f"view_{model._meta.model_name}")
        codenames = [codename for codename, _ in model._meta.permissions]
        power |= Q(content_type=content_type, codename__in=codenames)
    return {
        VIEWERS: Permission.objects.filter(view),
        OPERATORS: Permission.objects.filter(view | power),
    }


class Command(BaseCommand):
    help = 'Create or update the "operators" and "viewers" groups.'

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            for name, wanted in group_permissions().items():
                group, created = Group.objects.get_or_create(name=name)
                have = set(group.permissions.values_list("pk", flat=True))
                want = set(wanted.values_list("pk", flat=True))
                group.permissions.set(want)
                added, removed = len(want - have), len(have - want)
                change = f"added {added}, removed {removed}" if added or removed else "unchanged"
                self.stdout.write(
                    f"{name}: {len(want)} permissions ({'created; ' if created else ''}{change})"
                )
