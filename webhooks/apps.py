from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"

    def ready(self) -> None:
        # Importing the declaring module declares its retention rules.
        from webhooks import retention  # noqa: F401
