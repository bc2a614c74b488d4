from django.apps import AppConfig


class CoreConfig(AppConfig):
    """Last in ``INSTALLED_APPS``: ``ready()`` runs after every app declared its own."""

    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from asyncwork import queues
        from core import checks  # noqa: F401  (its system checks)
        from core.celery import app

        # What a worker started without -Q consumes: default and every queue an app declared.
        app.conf.task_queues = queues.consumed()
