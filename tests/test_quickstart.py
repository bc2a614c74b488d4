"""The machinery's distribution as a stranger meets it: its wheel, built from
``packages/asyncwork``, installed into a new virtualenv with nothing from this repository, and
the README's five-minute quickstart followed word for word in a project made by
``django-admin startproject``: each file it shows written, each command it shows run, each output
it shows compared (``...`` stands for any text). The project's PostgreSQL is a cluster of this
test's own and its broker a Redis of its own, so the quickstart's database name and queues
touch nothing else on the machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chaos.stack import Postgres
from stack.process import ROOT, Process
from tests.helpers.redis_server import PrivateRedis

pytestmark = pytest.mark.slow

DISTRIBUTION = ROOT / "packages" / "asyncwork"
# A command whose output the README shows is run again until it matches, for this long: the
# worker catches up in the background.
CATCH_UP_SECONDS = 30


@dataclass
class Step:
    command: str = ""  # a shell command, or
    path: str = ""  # a file the README shows, with its text
    text: str = ""
    expected: list[str] = field(default_factory=list)


def quickstart(readme: str) -> list[Step]:
    """The steps of the README's quickstart section, in order."""
    section = readme.split("## Five-minute quickstart\n", 1)[1].split("\n## ", 1)[0]
    steps: list[Step] = []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL):
        if language == "python":
            first = body.partition("\n")[0]
            assert first.startswith("# "), f"a file block names its path first: {first!r}"
            steps.append(Step(path=first[2:].strip(), text=body))
            continue
        assert language == "console", language
        for line in body.splitlines():
            if line.startswith("$ "):
                steps.append(Step(command=line[2:]))
            elif line:
                steps[-1].expected.append(line)
    return steps


def shown(expected: str, output: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return any(re.fullmatch(pattern, line) for line in output.splitlines())


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


def test_the_readme_quickstart_works_from_the_wheel_in_a_new_project(
    tmp_path: Path, postgres: Postgres, private_redis: PrivateRedis
) -> None:
    # Built from a copy: the build writes nothing into the checkout.
    source = tmp_path / "asyncwork"
    shutil.copytree(
        DISTRIBUTION,
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(wheels)],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("asyncwork-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]

    project = tmp_path / "project"
    project.mkdir()
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

    readme = (DISTRIBUTION / "README.md").read_text()
    steps = quickstart(readme)
    assert [s.path for s in steps if s.path] == [
        "mysite/settings.py",
        "mysite/celery.py",
        "mysite/__init__.py",
        "shop/models.py",
        "shop/tasks.py",
        "shop/services.py",
    ]
    background: list[Process] = []
    try:
        for step in steps:
            if step.path:
                target = project / step.path
                if step.path.endswith("settings.py"):  # "Add to the end of"
                    target.write_text(target.read_text() + "\n" + step.text)
                else:
                    target.write_text(step.text)
                continue
            if step.command.endswith(" &"):
                background.append(
                    Process(
                        ["bash", "-c", step.command[:-2]],
                        name="worker",
                        env=env,
                        log=tmp_path / "worker.log",
                        cwd=project,
                    )
                )
                continue
            deadline = time.monotonic() + (CATCH_UP_SECONDS if step.expected else 0)
            while True:
                result = subprocess.run(
                    ["bash", "-c", step.command],
                    cwd=project,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert result.returncode == 0, (step.command, result.stdout, result.stderr)
                missing = [line for line in step.expected if not shown(line, result.stdout)]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert not missing, (step.command, result.stdout, background[0].log_tail())
    finally:
        for process in background:
            process.stop(grace=10)
