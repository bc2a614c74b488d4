from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    """The email guarantee; its declarations to the machinery sit beside the code they name."""

    name = "invoicing"

    def ready(self) -> None:
        # Importing the declaring modules declares them.
        from invoicing import bounces, deadletters, probes, services, tasks  # noqa: F401
