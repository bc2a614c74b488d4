"""The Django project: settings, URLs, the WSGI and Celery applications. It wires the apps
together and holds no machinery and no domain of its own.

Importing it creates the Celery app (``celery -A core``), so that ``@shared_task`` and the
outbox publish through it in every process that loads the project."""

from core.celery import app as celery_app

__all__ = ("celery_app",)
