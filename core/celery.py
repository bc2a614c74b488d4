"""The Celery application: ``celery -A core worker|beat`` need no flags; configuration is
``core.settings``' ``CELERY_`` options, and the machinery's (``asyncwork.install``)."""

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

import asyncwork
from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

app = Celery("core")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _settings_load(**_: Any) -> None:
    """Before the first configuration read (in the CLI, while click parses): settings that do
    not load stop the command with one line, not a traceback through click."""
    settings_load_or_exit()


@setup_logging.connect
def _django_logging(loglevel: int | str | None = None, **_: Any) -> None:
    """Workers and beat log as the web does (``settings.LOGGING``: the format, masked addresses,
    the log context's fields): a receiver here keeps Celery from configuring logging its own way.
    A ``--loglevel`` more verbose than ``LOG_LEVEL`` still applies (the demo waits for a worker's
    INFO "ready.")."""
    level = logging.getLevelName(loglevel.upper()) if isinstance(loglevel, str) else loglevel
    root = logging.getLogger()
    if isinstance(level, int) and level and level < root.getEffectiveLevel():
        root.setLevel(level)


asyncwork.install(app)
app.autodiscover_tasks()
