"""Dead letters as the application makes them: a refused recipient, through the real webhook,
worker and SMTP server."""

from __future__ import annotations

from django.test import Client

from asyncwork.models import DeadLetter
from invoicing.models import Invoice
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.stripe import paid_event, post_event


def refused_invoice_dead_letter(client: Client, smtp: SmtpServer) -> tuple[Invoice, DeadLetter]:
    """A paid invoice whose recipient the SMTP server refuses: one dead letter (a worker must
    be running)."""
    smtp.handler.faults.refuse = {"typo@exmaple.com"}
    post_event(client, stripe_events.encode(paid_event(customer_email="typo@exmaple.com")))
    assert wait_until(DeadLetter.objects.exists, timeout=20)
    return Invoice.objects.get(), DeadLetter.objects.get()
