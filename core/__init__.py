"""The Django project: it wires the apps together. Importing it creates the Celery app, so
``@shared_task`` and the outbox publish through it in every process."""

from core.celery import app as celery_app

__all__ = ("celery_app",)
