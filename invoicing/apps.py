from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    name = "invoicing"

    def ready(self) -> None:
        from core import health, metrics, probes
        from core.dashboard import breaker_figures
        from core.deadletters import register_describer
        from invoicing.deadletters import resend_dead_letter_subjects, send_dead_letter_subjects
        from invoicing.mail import failure_in_words
        from invoicing.metrics import email_breaker_metrics, email_delivery_metrics
        from invoicing.probes import (
            email_breaker_check,
            email_breaker_probe,
            email_figures,
            email_probe,
        )
        from invoicing.services import RESEND_INVOICE_EMAIL_TASK, SEND_INVOICE_EMAIL_TASK

        health.register_check("breaker", email_breaker_check, critical=False)
        metrics.register_source("emails", email_delivery_metrics, database=True)
        metrics.register_source("email_breaker", email_breaker_metrics, database=False)
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
        register_describer(
            SEND_INVOICE_EMAIL_TASK, send_dead_letter_subjects, failure=failure_in_words
        )
        register_describer(
            RESEND_INVOICE_EMAIL_TASK, resend_dead_letter_subjects, failure=failure_in_words
        )
