from django.apps import AppConfig


class CoreConfig(AppConfig):
    """The project. Last in ``INSTALLED_APPS``: its ``ready()`` runs once every app has made
    its declarations in its own, and wires what must be fixed before a worker starts."""

    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from asyncwork import queues
        from core import checks  # noqa: F401  (its system checks)
        from core.celery import app

        # What a worker started without -Q consumes: default and every queue an app declared.
        app.conf.task_queues = queues.consumed()
