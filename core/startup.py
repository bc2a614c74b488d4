"""What gunicorn and ``celery -A core worker|beat`` do first: load the settings, or stop with
one line saying what to fix; a traceback would bury it."""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def settings_load_or_exit(*, exit_code: int = 1) -> None:
    """Import the settings; if they refuse the configuration, print ``Configuration error:
    <why>`` on stderr and exit with ``exit_code``."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    try:
        _ = settings.INSTALLED_APPS
    except ImproperlyConfigured as exc:
        print(f"Configuration error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code) from None
