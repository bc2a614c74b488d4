"""core.startup: every entry point, started as the README, compose.yaml and the Docker image
start it, from a shell's bare environment, refuses a production configuration without its
secrets with exactly one line on stderr naming what is missing, a non-zero exit status and no
traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stack.net import free_port
from stack.process import ROOT
from tests.helpers.environment import PRODUCTION, clean_env, manage

pytestmark = pytest.mark.slow  # each test starts an entry point in a process of its own

BIN = Path(sys.executable).parent
ENTRY_POINTS = {
    "manage.py check": [sys.executable, "manage.py", "check"],
    # A command of the project's own, which Django finds only in settings that load.
    "manage.py setup_periodic_tasks": [sys.executable, "manage.py", "setup_periodic_tasks"],
    # Reads ./gunicorn.conf.py: the master stops before it logs or forks anything.
    "gunicorn core.wsgi": [str(BIN / "gunicorn"), "core.wsgi", "-b", "127.0.0.1:0"],
    "celery -A core worker": [str(BIN / "celery"), "-A", "core", "worker"],
    "celery -A core beat": [str(BIN / "celery"), "-A", "core", "beat"],
}


def start(
    argv: list[str], env: dict[str, str], cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=60, check=False
    )


def refusal(*missing: str) -> str:
    if len(missing) == 1:
        return (
            f"Configuration error: {missing[0]} must be set when DJANGO_DEBUG is off "
            "(the default): it has no production default."
        )
    return (
        f"Configuration error: {' and '.join(missing)} must be set when DJANGO_DEBUG is off "
        "(the default): they have no production default."
    )


@pytest.mark.parametrize("missing", ["DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_each_entry_point_refuses_a_missing_secret_in_one_line(
    entry_point: str, missing: str
) -> None:
    # No DJANGO_DEBUG: production is what a copy started with nothing set runs as.
    env = {k: v for k, v in PRODUCTION.items() if k != missing}
    result = start(ENTRY_POINTS[entry_point], env)
    assert result.returncode != 0
    assert result.stderr.splitlines() == [refusal(missing)], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("entry_point", ["gunicorn core.wsgi", "celery -A core worker"])
def test_nothing_set_names_every_missing_secret(entry_point: str) -> None:
    result = start(ENTRY_POINTS[entry_point], {})
    assert result.returncode != 0
    assert result.stderr.splitlines() == [refusal("DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET")], (
        result.stderr
    )


@pytest.mark.parametrize(
    ("refused", "says"),
    [
        ({"STRIPE_LIVEMODE": "production"}, "STRIPE_LIVEMODE must be live, test or any"),
        # A provider's API elsewhere than its own host (core.providers).
        (
            {"STRIPE_API_BASE": "http://127.0.0.1:12111"},
            "STRIPE_API_BASE points at http://127.0.0.1:12111, not Stripe's own API",
        ),
        (
            {"ANYMAIL_WEBHOOK_SECRET": "postmark:s3cret"},
            "ANYMAIL_WEBHOOK_SECRET must be user:password with a password of at least 24",
        ),
    ],
)
@pytest.mark.parametrize("entry_point", ["gunicorn core.wsgi", "celery -A core worker"])
def test_any_refused_setting_is_one_line_too(
    entry_point: str, refused: dict[str, str], says: str
) -> None:
    result = start(ENTRY_POINTS[entry_point], {**PRODUCTION, **refused})
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Configuration error: {says}"), line


def test_gunicorn_started_elsewhere_stops_without_a_traceback(tmp_path: Path) -> None:
    """Outside the project's directory and without -c, gunicorn reads no configuration of
    ours and the worker loads core.wsgi: it says why once, and its exit status makes the
    arbiter stop instead of forking it again and again."""
    argv = [str(BIN / "gunicorn"), "core.wsgi", "-b", f"127.0.0.1:{free_port()}", "-w", "1"]
    env = {k: v for k, v in PRODUCTION.items() if k != "DJANGO_SECRET_KEY"}
    result = start(argv, env, cwd=tmp_path)
    assert result.returncode == 4  # gunicorn's "App failed to load"
    assert "Traceback" not in result.stderr
    naming = [line for line in result.stderr.splitlines() if "DJANGO_SECRET_KEY" in line]
    assert naming == [refusal("DJANGO_SECRET_KEY")], result.stderr
    assert "App failed to load." in result.stderr


def test_a_missing_database_is_one_line_saying_how_to_create_it() -> None:
    name = f"invoicing_missing_{os.getpid()}"
    run = manage(
        "migrate",
        env={"DJANGO_DEBUG": "1", "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{name}"},
    )
    assert run.returncode == 1
    assert run.stderr == (
        f'Database error: database "{name}" does not exist on 127.0.0.1:5432 (DATABASE_URL '
        f"names it): create it with `createdb -h 127.0.0.1 -p 5432 -U postgres {name}`\n"
    )


def test_a_database_server_that_does_not_answer_is_one_line() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = unused.getsockname()[1]
        run = manage(
            "migrate",
            env={"DJANGO_DEBUG": "1", "DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/any"},
        )
    assert run.returncode == 1
    assert run.stderr == (
        f"Database error: PostgreSQL does not answer on 127.0.0.1:{port} (DATABASE_URL): start "
        "it, or set DATABASE_URL to one that does\n"
    )
