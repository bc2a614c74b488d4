"""Processes started from a shell's bare environment, on production settings: what a copy of
the project does when nothing of this test run's own settings is set."""

from __future__ import annotations

import os
import subprocess
import sys

from stack.net import HOST, free_port
from stack.process import ROOT

# Production as a deployment configures it: no DJANGO_DEBUG at all, because off is the default.
PRODUCTION = {
    "DJANGO_SECRET_KEY": "k3y-" + "a1B2c3D4e5F6g7H8i9J0" * 3,
    "STRIPE_WEBHOOK_SECRET": "whsec_live_example",
    "DJANGO_ALLOWED_HOSTS": "billing.example.com",
}


def clean_env(**env: str) -> dict[str, str]:
    """A shell's bare environment (PATH, HOME, LANG) plus ``env``: nothing of this test run's
    own settings. The database and the broker point where nothing listens, so a process that
    was meant to refuse to start, and did not, touches nobody's data."""
    nowhere = free_port()  # bound, then closed: nothing listens there
    return {
        **{k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ},
        "DATABASE_URL": f"postgres://postgres@{HOST}:{nowhere}/nowhere",
        "CELERY_BROKER_URL": f"redis://{HOST}:{nowhere}/0",
        "REDIS_URL": f"redis://{HOST}:{nowhere}/1",
        **env,
    }


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python manage.py <args>`` on core.settings with ``env`` and nothing else set."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=clean_env(DJANGO_SETTINGS_MODULE="core.settings", **env),
        timeout=60,
        check=False,
    )


def settings_read(*names: str, env: dict[str, str]) -> list[str]:
    """The repr of each setting in ``names`` as ``manage.py`` sees it with ``env``."""
    code = "from django.conf import settings as s; " + "; ".join(
        f"print(repr(s.{name}))" for name in names
    )
    result = manage("shell", "--no-imports", "-c", code, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()
