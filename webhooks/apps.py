from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"

    def ready(self) -> None:
        from asyncwork.retention import retention_register
        from webhooks.retention import webhook_bodies_clear, webhook_events_purge

        # Bodies first: an event past both retentions is cleared, then deleted.
        retention_register("webhook_bodies_cleared", webhook_bodies_clear)
        retention_register("webhook_events", webhook_events_purge)
