"""The invoicing app's tasks: Django's ``@task`` on asyncwork's backend, on a queue of their own
(other work never delays an email). Thin: each loads by id and calls one service. What they may
raise decides what follows (``asyncwork.runner``): a transient failure is retried on the policy
below, ``ProviderUnavailable`` (the breaker open) runs again later without spending an attempt,
anything else fails the task and dead-letters it."""

from __future__ import annotations

from django.conf import settings
from django_tasks import task
from prometheus_client import Counter

from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.errors import PermanentError
from asyncwork.heartbeat import heartbeat_owner
from invoicing import delivery
from invoicing.models import EmailDelivery

WORKER_EMAILS_SENT = Counter(
    metric_name("worker_emails_sent"),
    "Emails this worker handed to the SMTP server or provider (runs that returned 'sent').",
    ["task"],
)

EMAIL_QUEUE = "email"
_EMAIL = {
    "queue_name": EMAIL_QUEUE,
    "max_attempts": settings.EMAIL_MAX_ATTEMPTS,
    "backoff": settings.EMAIL_RETRY_BACKOFF_BASE,
    "backoff_max": settings.EMAIL_RETRY_BACKOFF_MAX,
    "time_limit": settings.EMAIL_TASK_SOFT_TIME_LIMIT,
}


def _sent(task_name: str, result: str) -> str:
    if result == "sent":
        WORKER_EMAILS_SENT.labels(task=task_name).inc()
    return result


@task(**_EMAIL)
def send_invoice_email(invoice_id: int) -> str:
    """Email a paid invoice once."""
    result = delivery.invoice_email_send(invoice_id=invoice_id, owner=heartbeat_owner())
    return _sent(send_invoice_email.module_path, result)


@task(**_EMAIL)
def resend_invoice_email(delivery_id: int) -> str:
    """Send a deliberate resend, once, under the key its request created."""
    requested = EmailDelivery.objects.filter(pk=delivery_id).first()
    if requested is None:
        raise PermanentError(f"email delivery {delivery_id} does not exist")
    result = delivery.invoice_email_send(
        invoice_id=requested.invoice_id, owner=heartbeat_owner(), key=requested.key
    )
    return _sent(resend_invoice_email.module_path, result)
