"""The operator audit trail: one ``OperatorAction`` row per action the services announce
(``asyncwork.audit.operator_acted``), written by the receiver inside the acting transaction, so
only a committed action has a row. Connected by ``OperatorsConfig.ready``."""

from __future__ import annotations

from typing import Any

from django.contrib.contenttypes.models import ContentType
from django.db import models

from asyncwork.contrib.operators.models import OperatorAction


def operator_action_keep(
    sender: type[models.Model],
    *,
    action: str,
    actor: str,
    target: models.Model,
    detail: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    **_: Any,
) -> None:
    OperatorAction.objects.create(
        action=action,
        actor=actor[:150],
        target_type=ContentType.objects.get_for_model(target),
        target_id=str(target.pk),
        target_label=str(target)[:255],
        before=before,
        after=after,
        detail=detail[:500],
    )
