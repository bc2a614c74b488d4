from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "webhooks"

    def ready(self) -> None:
        # Importing the declaring modules declares their retention rules, probes, job and signal.
        from webhooks import probes, reconcile, retention, stripe_api  # noqa: F401
