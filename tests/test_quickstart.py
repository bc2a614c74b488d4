"""The machinery's distribution as a stranger meets it: every code block of its README, in order,
as a reader follows them. The install block is run as written from a copy of the repository's
``packages/asyncwork`` (``python`` there is this test's interpreter, which has ``build``; ``pip``
is a new virtualenv's, with nothing from this repository); then, in a project made by ``django-admin
startproject``, each file shown is written (``mysite/settings.py`` added to, as the README says)
and each command shown run, its output compared with the lines shown as the docs' tests compare
them (tests/helpers/docblocks.py: a word holding a digit stands for any such word, ``...`` for
any text). The project's PostgreSQL is a cluster of this test's own and its broker a Redis of its
own, so the README's database name and queues touch nothing else on the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chaos.stack import Postgres
from stack.process import ROOT, Process
from tests.helpers import docblocks
from tests.helpers.redis_server import PrivateRedis

DISTRIBUTION = ROOT / "packages" / "asyncwork"
README = DISTRIBUTION / "README.md"
# A command whose output the README shows is run again until it matches, for this long: the
# worker catches up in the background.
CATCH_UP_SECONDS = 30


def _install_ends_at() -> int:
    """The README's line where the blocks run in the new project begin."""
    lines = README.read_text().splitlines()
    return lines.index("## Five-minute quickstart") + 1


def test_every_block_of_the_readme_is_a_file_or_commands() -> None:
    """A Python block names the file it is on its first line; every other block is commands."""
    for block in docblocks.blocks(README):
        if block.language == "python":
            first = block.text.partition("\n")[0]
            assert first.startswith("# "), (block.where, first)
            assert " " not in first[2:].strip(), (block.where, first)
        else:
            assert block.language == "console", block.where
            assert docblocks.commands(block), block.where


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    """A cluster of this test's own, under /tmp (the postgres user, who runs it, cannot enter
    pytest's own directories)."""
    root = Path(tempfile.mkdtemp(prefix="quickstart-postgres-"))
    cluster = Postgres(root / "cluster")
    try:
        cluster.start()
        yield cluster
        cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(
    command: docblocks.Command,
    *,
    cwd: Path,
    env: dict[str, str],
    log: Callable[[], str] = lambda: "",
) -> None:
    """Run ``command`` until it shows what the README shows, for up to ``CATCH_UP_SECONDS``
    (``log``: what else to say if it does not)."""
    deadline = time.monotonic() + (CATCH_UP_SECONDS if command.shown else 0)
    while True:
        result = subprocess.run(
            ["bash", "-c", command.text],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        missing = [s for s in command.shown if not docblocks.shown(s, result.stdout)]
        if (result.returncode == 0 and not missing) or time.monotonic() > deadline:
            break
        time.sleep(1)
    where = f"{README.relative_to(ROOT)}:{command.line}"
    assert result.returncode == 0, (where, result.stdout, result.stderr[-3000:], log())
    assert not missing, (where, missing, result.stdout, log())


@pytest.mark.slow
def test_every_block_of_the_readme_runs_from_the_wheel_in_a_new_project(
    tmp_path: Path, postgres: Postgres, private_redis: PrivateRedis
) -> None:
    blocks = docblocks.blocks(README)
    install = [b for b in blocks if b.line < _install_ends_at()]
    in_project = [b for b in blocks if b.line > _install_ends_at()]
    assert [b.language for b in install] == ["console"]

    # The repository's root as the install block expects it, with the distribution as it is in
    # the checkout: the build writes nothing into the checkout.
    repository = tmp_path / "repository"
    shutil.copytree(
        DISTRIBUTION,
        repository / "packages" / "asyncwork",
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"),
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tools / "python").chmod(0o755)
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "LANG": "C.UTF-8",
        "VIRTUAL_ENV": str(venv),
        "PGHOST": "127.0.0.1",
        "PGPORT": str(postgres.port),
        "PGUSER": "postgres",
        "CELERY_BROKER_URL": private_redis.url,
    }
    # pip is the new virtualenv's; PIP_* (where this machine finds packages) pass through.
    pip = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    install_env = {**env, **pip, "PATH": f"{tools}:{env['PATH']}"}
    for block in install:
        for command in docblocks.commands(block):
            _run(command, cwd=repository, env=install_env)

    project = tmp_path / "project"
    project.mkdir()
    # Nothing of this repository is on the new project's path: the machinery is the wheel's.
    where = subprocess.run(
        ["python", "-c", "import asyncwork; print(asyncwork.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), where

    files = [b.text.partition("\n")[0][2:].strip() for b in in_project if b.language == "python"]
    assert files == [
        "mysite/settings.py",
        "mysite/celery.py",
        "mysite/__init__.py",
        "shop/models.py",
        "shop/tasks.py",
        "shop/services.py",
        "shop/apps.py",
        "shop/deadletters.py",
    ]
    background: list[Process] = []
    try:
        for block in in_project:
            if block.language == "python":
                target = project / block.text.partition("\n")[0][2:].strip()
                if target.name == "settings.py":  # "Add to the end of"
                    target.write_text(target.read_text() + "\n" + block.text)
                else:
                    target.write_text(block.text)
                continue
            for command in docblocks.commands(block):
                if command.text.endswith(" &"):
                    background.append(
                        Process(
                            ["bash", "-c", command.text[:-2]],
                            name="worker",
                            env=env,
                            log=tmp_path / "worker.log",
                            cwd=project,
                        )
                    )
                    continue
                _run(command, cwd=project, env=env, log=lambda: background[0].log_tail())
    finally:
        for process in background:
            process.stop(grace=10)
