"""Celery tasks of the invoicing app: thin, load by id, call one service."""

from __future__ import annotations

from django.conf import settings
from prometheus_client import Counter

from asyncwork.errors import Deferred, PermanentError
from asyncwork.heartbeat import heartbeat_owner
from asyncwork.tasks import ReliableTask, RetryPolicy, reliable_task
from invoicing import services
from invoicing.models import EmailDelivery

WORKER_EMAILS_SENT = Counter(
    "invoicing_worker_emails_sent",
    "Emails this worker handed to the SMTP server (task runs that returned 'sent').",
    ["task"],
)


def _send(task: ReliableTask, *, invoice_id: int, key: str | None = None) -> str:
    try:
        result = services.invoice_email_send(
            invoice_id=invoice_id, owner=heartbeat_owner(), key=key
        )
    except Deferred as exc:
        # The provider's breaker is open: run again after its cool-down, no attempt spent.
        raise task.defer(exc) from exc
    if result == "sent":
        WORKER_EMAILS_SENT.labels(task=task.name).inc()
    return result


EMAIL_RETRY = RetryPolicy(
    attempts=settings.EMAIL_MAX_ATTEMPTS,
    backoff=settings.EMAIL_RETRY_BACKOFF_BASE,
    backoff_max=settings.EMAIL_RETRY_BACKOFF_MAX,
)
_EMAIL_TIME_LIMITS = {
    "soft_time_limit": settings.EMAIL_TASK_SOFT_TIME_LIMIT,
    "time_limit": settings.EMAIL_TASK_TIME_LIMIT,
}


@reliable_task(name=services.SEND_INVOICE_EMAIL_TASK, retry=EMAIL_RETRY, **_EMAIL_TIME_LIMITS)
def send_invoice_email(self: ReliableTask, invoice_id: int) -> str:
    """Email a paid invoice once."""
    return _send(self, invoice_id=invoice_id)


@reliable_task(name=services.RESEND_INVOICE_EMAIL_TASK, retry=EMAIL_RETRY, **_EMAIL_TIME_LIMITS)
def resend_invoice_email(self: ReliableTask, delivery_id: int) -> str:
    """Send a deliberate resend, once, under the key its request created."""
    delivery = EmailDelivery.objects.filter(pk=delivery_id).first()
    if delivery is None:
        raise PermanentError(f"email delivery {delivery_id} does not exist")
    return _send(self, invoice_id=delivery.invoice_id, key=delivery.key)
