"""What gunicorn and ``celery -A core worker|beat`` do first: load the settings, and refuse any that
no process may start with, or stop with one line saying what to fix; a traceback would bury it."""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from asyncwork.checks import settings_refusals as machinery_refusals
from core.checks import settings_refusals


def settings_refuse() -> None:
    """Raise ``ImproperlyConfigured`` naming the first setting refused: the project's
    (``core.checks``), then the machinery's ``ASYNCWORK`` (``asyncwork.checks``)."""
    if refused := [*settings_refusals(), *machinery_refusals()]:
        raise ImproperlyConfigured(refused[0])


def settings_load_or_exit(*, exit_code: int = 1) -> None:
    """Import the settings; if they refuse the configuration, print ``Configuration error:
    <why>`` on stderr and exit with ``exit_code``."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    try:
        _ = settings.INSTALLED_APPS
        settings_refuse()
    except ImproperlyConfigured as exc:
        print(f"Configuration error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code) from None
