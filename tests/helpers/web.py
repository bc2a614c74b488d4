"""The web application as it is deployed, for the tests that need it so: the static files
collected by the Docker image's own build step (read from the Dockerfile and run as written),
and gunicorn on the production settings module (``core.settings``, not ``tests.settings``)
serving them with WhiteNoise's compressed, hashed storage, on this test run's database, broker
and cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from django.urls import reverse

from stack import launch
from stack.net import HOST, free_port
from stack.process import ROOT, Process
from tests.helpers.processes import worker_env

DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = "staticfiles.json"  # what Django's manifest storage writes into STATIC_ROOT


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, as (keyword, arguments), continuation lines
    joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def collectstatic_step() -> str:
    """The shell command of the Dockerfile's one RUN that collects the static files."""
    steps = [
        arguments
        for keyword, arguments in dockerfile_instructions()
        if keyword == "RUN" and re.search(r"\bmanage\.py collectstatic\b", arguments)
    ]
    assert len(steps) == 1, f"expected one RUN of manage.py collectstatic, found {steps}"
    return steps[0]


def collect_static(static_root: Path) -> Path:
    """Fill ``static_root`` as the image build fills /app/staticfiles: the Dockerfile's own
    command, with the image's settings module and nothing else of this run's environment, and
    with no database or Redis answering (there is none at build). Return ``static_root``."""
    nowhere = free_port()  # bound, then closed: nothing listens there
    python = Path(sys.executable).parent  # the image's `python` is this one here
    env = {
        **{k: os.environ[k] for k in ("HOME", "LANG") if k in os.environ},
        "PATH": f"{python}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "DJANGO_SETTINGS_MODULE": "core.settings",  # the image's ENV
        "DATABASE_URL": f"postgres://postgres@{HOST}:{nowhere}/nowhere",
        "CELERY_BROKER_URL": f"redis://{HOST}:{nowhere}/0",
        "REDIS_URL": f"redis://{HOST}:{nowhere}/1",
        # The one difference: here, not /app/staticfiles.
        "DJANGO_STATIC_ROOT": str(static_root),
    }
    result = subprocess.run(
        ["sh", "-c", collectstatic_step()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (static_root / MANIFEST).is_file(), result.stdout + result.stderr
    return static_root


def hashed_name(static_root: Path, name: str) -> str:
    """The name collectstatic gave ``name`` (admin/css/base.css -> admin/css/base.<hash>.css),
    from the manifest {% static %} reads."""
    paths: dict[str, str] = json.loads((static_root / MANIFEST).read_text())["paths"]
    return paths[name]


def production_gunicorn(
    static_root: Path, *, log_path: Path, workers: int = 2, **extra_env: str
) -> Process:
    """gunicorn on ``core.settings`` with STATIC_ROOT at ``static_root``, on this test run's
    database, broker and cache (``worker_env``); ready, with it, once Django answers."""
    env = worker_env(
        0,  # gunicorn sends no email
        None,
        DJANGO_SETTINGS_MODULE="core.settings",
        DJANGO_STATIC_ROOT=str(static_root),
        **extra_env,
    )
    return launch.gunicorn(
        env,
        config=launch.GunicornConfig(workers=workers),
        log=log_path,
        ready_path=reverse("webhooks:stripe"),
    )
