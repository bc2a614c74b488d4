"""Reads the admin and the API share."""

from __future__ import annotations

from typing import Any

from django.db.models import Exists, IntegerField, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce, JSONArray

from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import payment_emails, resend_invoice_email, send_invoice_email

EMAIL_STATUSES = ("pending", "sending", "sent", "dead_lettered", "none")


def invoices_with_email_status() -> QuerySet[Invoice]:
    """Invoices annotated with ``email_state``, ``email_attempts``, ``email_sent_at`` (of the
    ``invoice_email_sent`` key) and ``email_dead_lettered`` (a dead letter waits for it)."""
    delivery = payment_emails().filter(invoice=OuterRef("pk"))
    return Invoice.objects.annotate(
        email_state=Subquery(delivery.values("state")[:1]),
        email_attempts=Coalesce(
            Subquery(delivery.values("attempts")[:1], output_field=IntegerField()), 0
        ),
        email_sent_at=Subquery(delivery.values("sent_at")[:1]),
        email_dead_lettered=Exists(
            DeadLetter.objects.filter(
                task=send_invoice_email.module_path,
                args=JSONArray(OuterRef("pk")),
                replayed_at__isnull=True,
            )
        ),
    )


def email_status(invoice: Invoice) -> str:
    """pending / sending / sent / dead_lettered for a paid invoice; none for an unpaid one.
    Needs the annotations of ``invoices_with_email_status``."""
    state = getattr(invoice, "email_state", None)
    if state == EmailDelivery.State.SENT:
        return "sent"
    if getattr(invoice, "email_dead_lettered", False):
        return "dead_lettered"
    if state == EmailDelivery.State.SENDING:
        return "sending"
    if invoice.status == Invoice.Status.PAID:
        return "pending"
    return "none"


def filter_by_email_status(queryset: QuerySet[Any], status: str) -> QuerySet[Any]:
    sent = {"email_state": EmailDelivery.State.SENT}
    if status == "sent":
        return queryset.filter(**sent)
    if status == "dead_lettered":
        return queryset.exclude(**sent).filter(email_dead_lettered=True)
    if status == "sending":
        return queryset.filter(email_state=EmailDelivery.State.SENDING, email_dead_lettered=False)
    if status == "pending":
        return queryset.filter(
            Q(email_state__isnull=True) | Q(email_state=EmailDelivery.State.FAILED),
            status=Invoice.Status.PAID,
            email_dead_lettered=False,
        )
    return queryset.exclude(status=Invoice.Status.PAID)


def email_delivery_outcome(delivery: EmailDelivery) -> str:
    """A resend's outcome now: ``sent``; ``failed`` while its job is dead-lettered; otherwise
    ``queued`` (waiting, sending, or between attempts)."""
    if delivery.state == EmailDelivery.State.SENT:
        return "sent"
    dead = DeadLetter.objects.filter(
        task=resend_invoice_email.module_path, args=[delivery.pk], replayed_at__isnull=True
    ).exists()
    return "failed" if dead else "queued"


def invoice_dead_letters(invoice: Invoice) -> QuerySet[DeadLetter]:
    """The dead letters of the invoice's payment email and resends, newest first."""
    resends = [[pk] for pk in invoice.emails.values_list("pk", flat=True)]
    return DeadLetter.objects.filter(
        Q(task=send_invoice_email.module_path, args=[invoice.pk])
        | Q(task=resend_invoice_email.module_path, args__in=resends)
    ).order_by("-created_at", "-pk")
