from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"

    def ready(self) -> None:
        # Importing the declaring modules declares their retention rules, probe and signal.
        from webhooks import retention, stripe_api  # noqa: F401
