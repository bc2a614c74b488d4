"""Shared async machinery (outbox, dead letters, job locks) and the project's settings."""

from core.celery import app as celery_app

__all__ = ("celery_app",)
