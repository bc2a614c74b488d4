from django.apps import AppConfig
from django.core import checks


class CoreConfig(AppConfig):
    """The project. Last in ``INSTALLED_APPS``: its ``ready()`` runs once every app has filled
    the registries in its own, and wires what must be fixed before a worker starts."""

    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from asyncwork import queues
        from core.celery import app
        from core.checks import https_opt_out_check

        checks.register(https_opt_out_check, checks.Tags.security, deploy=True)
        # What a worker started without -Q consumes: default and every queue an app declared.
        app.conf.task_queues = queues.consumed()
