"""The audit trail of what operators did (``operators.audit`` writes it)."""

from __future__ import annotations

from django.contrib.contenttypes.fields import GenericForeignKey
from django.contrib.contenttypes.models import ContentType
from django.db import models


class OperatorAction(models.Model):
    """One thing an operator did to one row, through the admin, the API or a command."""

    action = models.CharField(max_length=100, db_index=True)
    # ``admin:<user>``, ``api:<user>`` or ``cli:<--actor, else the login name>``.
    actor = models.CharField(max_length=150, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    target_type = models.ForeignKey(
        ContentType, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    target_id = models.CharField(max_length=64, blank=True)
    target = GenericForeignKey("target_type", "target_id")
    # What the target was called when it was acted on: it outlives the row (retention).
    target_label = models.CharField(max_length=255, blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    detail = models.CharField(max_length=500, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["target_type", "target_id"], name="operatoraction_target_idx")
        ]

    def __str__(self) -> str:
        return f"{self.action} by {self.actor} on {self.target_label or '-'}"
