"""stack.launch: the one place the tools start the application's processes. No other file
under bench/, chaos/, scripts/, tests/ or stack/ writes down the command line of a Celery
worker or beat, of gunicorn or of nginx, and a launched process that cannot start says why."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from stack import launch
from stack.process import ProcessError
from tests.helpers.environment import clean_env
from tests.helpers.source import TOOLS, command_lines, python_files


def _celery(subcommand: str) -> Callable[[set[str]], bool]:
    def found(words: set[str]) -> bool:
        return subcommand in words and bool(words & frozenset({"celery", "-A"}))

    return found


def _program(name: str) -> Callable[[set[str]], bool]:
    def found(words: set[str]) -> bool:
        return any(word == name or word.endswith("/" + name) for word in words)

    return found


# What a command line of each program looks like, and the one file that may write it down.
PROGRAMS: dict[str, Callable[[set[str]], bool]] = {
    "a Celery worker": _celery("worker"),
    "Celery beat": _celery("beat"),
    "gunicorn": _program("gunicorn"),
    "nginx": _program("nginx"),
}
HOMES = {
    "a Celery worker": "stack/launch.py",
    "Celery beat": "stack/launch.py",
    "gunicorn": "stack/launch.py",
    "nginx": "stack/nginx.py",
}

# Files that name an entry point's command line without starting it through the kit, and why.
NAMED_NOT_LAUNCHED = {
    "tests/core/test_startup.py": (
        "runs each entry point exactly as the README and the image name it, to see it refuse "
        "a configuration without secrets: none gets past its settings"
    ),
    "tests/test_compose.py": "compares compose.yaml's commands with the entry points",
}


def written_down() -> dict[str, dict[str, list[int]]]:
    """For each program, the files (and lines) where its command line is written."""
    found: dict[str, dict[str, list[int]]] = {program: {} for program in PROGRAMS}
    for path in python_files(*TOOLS):
        for line, words in command_lines(path):
            for program, matches in PROGRAMS.items():
                if matches(words):
                    found[program].setdefault(path, []).append(line)
    return found


def test_each_program_is_started_from_one_place_only() -> None:
    found = written_down()
    for program, home in HOMES.items():
        # The check sees the kit's own command line: it would see another one.
        assert home in found[program], f"{program}: the check no longer finds {home}"
        elsewhere = {
            path: lines
            for path, lines in found[program].items()
            if path != home and path not in NAMED_NOT_LAUNCHED
        }
        assert elsewhere == {}, f"{program} started outside {home} (use stack.launch)"


def test_the_files_excused_still_need_it() -> None:
    """An exception that no longer applies is removed, not kept as a loophole."""
    found = written_down()
    for path in NAMED_NOT_LAUNCHED:
        assert any(path in files for files in found.values()), path


@pytest.mark.parametrize("start", ["worker", "beat"])
def test_a_process_refusing_to_start_says_why(start: str) -> None:
    """A worker (or beat) whose settings do not load exits at once; the error carries its
    one-line refusal, read from its log."""
    env = clean_env(DJANGO_SETTINGS_MODULE="core.settings", DJANGO_SECRET_KEY="x" * 60)
    assert "STRIPE_WEBHOOK_SECRET" not in env
    process = (
        launch.celery_worker(env, name="refused")
        if start == "worker"
        else launch.celery_beat(env, name="refused")
    )
    with pytest.raises(ProcessError) as refused:
        process.wait_ready(timeout=60)
    message = str(refused.value)
    assert "refused exited with" in message
    assert "Configuration error: STRIPE_WEBHOOK_SECRET must be set" in message
    assert not process.alive()
