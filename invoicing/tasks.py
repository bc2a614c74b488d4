"""Celery tasks of the invoicing app: thin, load by id, call one service."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from core.tasks import Deferred, ReliableTask
from invoicing import services


@shared_task(
    bind=True,
    base=ReliableTask,
    name=services.SEND_INVOICE_EMAIL_TASK,
    max_retries=settings.EMAIL_MAX_ATTEMPTS - 1,  # Celery counts retries, not attempts
    retry_backoff=settings.EMAIL_RETRY_BACKOFF_BASE,
    retry_backoff_max=settings.EMAIL_RETRY_BACKOFF_MAX,
    soft_time_limit=settings.EMAIL_TASK_SOFT_TIME_LIMIT,
    time_limit=settings.EMAIL_TASK_TIME_LIMIT,
)
def send_invoice_email(self: ReliableTask, invoice_id: int, outbox_id: int | None = None) -> str:
    """Email a paid invoice once. ``outbox_id`` only traces which outbox row published this."""
    try:
        return services.invoice_email_send(invoice_id=invoice_id, owner=self.request.id or "")
    except Deferred as exc:
        # The provider's breaker is open: run again after its cool-down, no attempt spent.
        raise self.defer(exc) from exc
