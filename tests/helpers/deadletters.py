"""Dead letters: one of the payment email's task as a row (``dead_letter``), and one as the
application makes it, a refused recipient, through the real webhook, worker and SMTP server."""

from __future__ import annotations

from typing import Any

from django.test import Client
from django.utils import timezone

from asyncwork.models import DeadLetter
from invoicing.models import Invoice
from invoicing.tasks import send_invoice_email
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.stripe import paid_event, post_event


def dead_letter(task_id: str = "t1", **fields: Any) -> DeadLetter:
    """A permanent failure of the payment email's task (a task the code has: a replay is not
    refused for a task it lacks), ``fields`` changed."""
    values: dict[str, Any] = {
        "task": send_invoice_email.module_path,
        "args": [1],
        "queue": "email",
        "reason": "permanent",
        "attempts": 1,
        "first_failed_at": timezone.now(),
        "last_failed_at": timezone.now(),
        **fields,
    }
    return DeadLetter.objects.create(task_id=task_id, **values)


def refused_invoice_dead_letter(client: Client, smtp: SmtpServer) -> tuple[Invoice, DeadLetter]:
    """A paid invoice whose recipient the SMTP server refuses: one dead letter (a worker must
    be running)."""
    smtp.handler.faults.refuse = {"typo@exmaple.com"}
    post_event(client, stripe_events.encode(paid_event(customer_email="typo@exmaple.com")))
    assert wait_until(DeadLetter.objects.exists, timeout=20)
    return Invoice.objects.get(), DeadLetter.objects.get()
