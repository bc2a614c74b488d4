from datetime import timedelta

from celery.signals import worker_process_shutdown
from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    """The email guarantee. Everything the machinery and the webhook endpoint know of it is
    declared here: its queue and routes, its scheduled jobs, the webhook events it handles,
    its health check, metrics, dashboard probes and dead-letter describers."""

    name = "invoicing"

    def ready(self) -> None:
        from asyncwork import health, metrics, probes, queues, rescue
        from asyncwork.dashboard import breaker_figures
        from asyncwork.deadletters import register_describer
        from asyncwork.jobs import job_register
        from invoicing.deadletters import resend_dead_letter_subjects, send_dead_letter_subjects
        from invoicing.jobs import (
            email_claims_recover,
            email_claims_rescue,
            invoices_reconcile,
            invoices_reconcile_now,
        )
        from invoicing.mail import smtp_connection_close
        from invoicing.metrics import (
            WORKER_EMAILS_SENT,
            email_breaker_metrics,
            email_delivery_metrics,
        )
        from invoicing.probes import (
            email_breaker_check,
            email_breaker_probe,
            email_figures,
            email_probe,
        )
        from invoicing.services import (
            EMAIL_QUEUE,
            EMAIL_RECOVERY_QUEUE,
            RESEND_INVOICE_EMAIL_TASK,
            SEND_INVOICE_EMAIL_TASK,
        )
        from invoicing.webhooks import PAYMENT_EVENT_TYPES, invoice_parse, invoice_payment_apply
        from webhooks.events import handler_register

        # Its own queues, so a flood of other jobs never delays an email; their depth is work
        # accepted and not yet done, which backpressure sheds on. The emails a safety net
        # enqueues again (older than any waiting) go first: their queue is declared first.
        queues.queue_register(EMAIL_RECOVERY_QUEUE, pressure=True, ahead_of=EMAIL_QUEUE)
        queues.queue_register(EMAIL_QUEUE, pressure=True)
        queues.route_register(SEND_INVOICE_EMAIL_TASK, EMAIL_QUEUE)
        queues.route_register(RESEND_INVOICE_EMAIL_TASK, EMAIL_QUEUE)

        for event_type in PAYMENT_EVENT_TYPES:
            handler_register(event_type, parse=invoice_parse, apply=invoice_payment_apply)

        # The safety nets of the email guarantee.
        job_register("email-claims-recover", email_claims_recover, every=timedelta(seconds=60))
        # At once, once the claim's owner is gone (its heartbeat lapsed): the workers-rescue job.
        rescue.rescue_register("email-claims", email_claims_rescue)
        # At once, too, after a broker restart or a database reconnect (asyncwork.recovery).
        job_register(
            "email-reconcile",
            invoices_reconcile,
            every=timedelta(seconds=120),
            on_recovery=invoices_reconcile_now,
        )

        health.register_check("breaker", email_breaker_check, critical=False)
        metrics.register_source("emails", email_delivery_metrics, database=True)
        metrics.register_source("email_breaker", email_breaker_metrics, database=False)
        metrics.register_result_counter(WORKER_EMAILS_SENT, result="sent")
        probes.register_probe(
            "emails", email_probe, title="Emails", figures=email_figures, database=True
        )
        probes.register_probe(
            "email_breaker",
            email_breaker_probe,
            title="Email provider (circuit breaker)",
            figures=breaker_figures,
            database=False,
        )
        register_describer(SEND_INVOICE_EMAIL_TASK, send_dead_letter_subjects)
        register_describer(RESEND_INVOICE_EMAIL_TASK, resend_dead_letter_subjects)
        # A worker process closes the SMTP connection it kept with QUIT on its way out.
        worker_process_shutdown.connect(
            smtp_connection_close, weak=False, dispatch_uid="invoicing.mail.close"
        )
