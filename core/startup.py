"""What the long-running entry points do first: gunicorn (``core.gunicorn_conf``, which
``./gunicorn.conf.py`` reuses, and ``core.wsgi``) and ``celery -A core worker|beat``
(``core.celery``). ``manage.py`` prints the same line from Django's own exception.

It loads the settings, or stops the process with one line on stderr saying what to fix (a
missing secret in production, a value out of range), a non-zero exit status and no traceback:
a traceback through importlib, Django and click, or one per gunicorn worker, would bury the
line the operator needs.
"""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def settings_load_or_exit(*, exit_code: int = 1) -> None:
    """Import the settings module (``DJANGO_SETTINGS_MODULE``, ``core.settings`` unless set);
    if it refuses the configuration, print ``Configuration error: <why>`` on stderr and exit
    with ``exit_code``. Settings already loaded are not read again."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    try:
        # The first attribute read imports the settings module (django.conf.LazySettings).
        _ = settings.INSTALLED_APPS
    except ImproperlyConfigured as exc:
        print(f"Configuration error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code) from None
