"""The tutorial arm: the paid-invoice email as a Django team writes it from the tutorials
(Stripe's webhook guide, Django's and Celery's documentation), none of the application's
services. A reference arm of ``bench.webhook_ingest`` and ``bench.pipeline``; the application
never imports it.

* ``stripe_webhook``, ``POST /bench/tutorial/webhook/`` (``bench.urls``), served by the
  application's gunicorn, with its settings and middleware: stripe-python's
  ``stripe.Webhook.construct_event`` checks the signature and parses the event; then, in one
  ``transaction.atomic``, ``get_or_create`` of the event by its id and, for a new
  ``invoice.paid``, ``update_or_create`` of the invoice and ``delay_on_commit`` of the email.
* ``send_invoice_email``, loaded into the application's Celery workers (``--include
  bench.tutorial``): loads the invoice and sends the application's email (its text and HTML
  templates, the HTML as ``send_mail``'s ``html_message``, as Django's documentation sends an
  alternative) with Django's ``send_mail`` through Django's SMTP backend, a connection per
  email; an SMTP or network error is retried by Celery (``autoretry_for``, ``retry_backoff``).
  The same message as the application's, so the arms differ by the guarantees, not the email.

What it leaves out is what the application's guarantees cost: no backpressure, no
outbox (an email whose publish fails after the commit is never sent), no claim (a message
delivered twice sends two emails, with two Message-IDs), no breaker, no dead letter.
"""

from __future__ import annotations

import os
import smtplib
from datetime import UTC, datetime

import stripe
from celery import shared_task
from celery.contrib.django.task import DjangoTask
from django.core.mail import get_connection, send_mail
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from invoicing.models import Invoice
from webhooks.models import WebhookEvent

TUTORIAL_TASK = "bench.tutorial_send_invoice_email"
# Django's own backend, as a new project has it; the workers' settings name the application's.
DJANGO_SMTP = "django.core.mail.backends.smtp.EmailBackend"


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    try:
        event = stripe.Webhook.construct_event(
            request.body,
            request.headers.get("Stripe-Signature", ""),
            os.environ["STRIPE_WEBHOOK_SECRET"],
        )
    except (ValueError, stripe.SignatureVerificationError):
        return JsonResponse({"error": "invalid payload or signature"}, status=400)

    with transaction.atomic():
        _, created = WebhookEvent.objects.get_or_create(
            event_id=event.id,
            defaults={
                "type": event.type,
                "livemode": event.livemode,
                "body": request.body.decode(),
                "state": WebhookEvent.State.PROCESSED,
            },
        )
        if created and event.type == "invoice.paid":
            paid = event.data.object
            invoice, _ = Invoice.objects.update_or_create(
                provider_invoice_id=paid.id,
                defaults={
                    "number": paid.number or "",
                    "customer_email": paid.customer_email or "",
                    "customer_name": paid.customer_name or "",
                    "amount_paid": paid.amount_paid,
                    "currency": paid.currency,
                    "status": paid.status,
                    "paid_at": datetime.fromtimestamp(paid.status_transitions.paid_at, UTC),
                    "provider_updated_at": datetime.fromtimestamp(event.created, UTC),
                },
            )
            send_invoice_email.delay_on_commit(invoice.pk)
    return JsonResponse({"received": True, "duplicate": not created})


@shared_task(
    name=TUTORIAL_TASK,
    base=DjangoTask,
    autoretry_for=(smtplib.SMTPException, OSError),
    retry_backoff=True,
    max_retries=5,
)
def send_invoice_email(invoice_id: int) -> None:
    invoice = Invoice.objects.get(pk=invoice_id)
    context = {
        "name": invoice.customer_name,
        "number": invoice.number,
        "amount": f"{invoice.amount_paid / 100:.2f} {invoice.currency.upper()}",
        "invoice_url": invoice.hosted_invoice_url,
    }
    send_mail(
        subject=f"Your invoice {invoice.number} is paid",
        message=render_to_string("invoicing/email/invoice_paid.txt", context),
        from_email=None,  # DEFAULT_FROM_EMAIL
        recipient_list=[invoice.customer_email],
        html_message=render_to_string("invoicing/email/invoice_paid.html", context),
        connection=get_connection(DJANGO_SMTP),
    )
