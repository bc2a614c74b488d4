from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    name = "invoicing"

    def ready(self) -> None:
        from core import health, metrics
        from invoicing.metrics import email_breaker_metrics, email_delivery_metrics
        from invoicing.services import email_breaker_check

        health.register_check("breaker", email_breaker_check, critical=False)
        metrics.register_source("emails", email_delivery_metrics, database=True)
        metrics.register_source("email_breaker", email_breaker_metrics, database=False)
