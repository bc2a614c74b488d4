from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    """The email guarantee. What the machinery and the webhook endpoint know of it is declared
    beside the code it names: its queues (``services``), the webhook events it handles
    (``webhooks``), its scheduled jobs and rescue (``jobs``), its health check and dashboard
    probes (``probes``), metrics (``metrics``), dead-letter describers (``deadletters``)."""

    name = "invoicing"

    def ready(self) -> None:
        # Importing the declaring modules declares them.
        from invoicing import deadletters, jobs, metrics, probes, tasks, webhooks  # noqa: F401
