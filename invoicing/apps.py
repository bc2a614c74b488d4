from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    name = "invoicing"

    def ready(self) -> None:
        from core import health
        from invoicing.services import email_breaker_check

        health.register_check("breaker", email_breaker_check, critical=False)
