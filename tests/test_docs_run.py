"""The tutorial and the how-to guides teach the code as it is: every code block of theirs runs
(tests/helpers/docblocks.py says how a block says what it is).

* An excerpt (``<!-- from: PATH -->``) is found in PATH, line for line.
* A page's examples (``<!-- example: PATH -->``) and its test (``<!-- test: PATH -->``) are
  written into a tree laid over the application (tests/helpers/docs_overlay.py) and the test is
  run with pytest, in a process of its own, on a database of its own; with no test block, a test
  that imports the examples is.
* Commands (``console``) are run in one shell per page, from the checkout, on this test's
  database and an SMTP server, web server and worker of its own, and what they show is
  compared, a shown command being run again for up to ``CATCH_UP_SECONDS`` while the worker
  catches up. A page with examples has its commands run in a process laid over with them, as
  its test is, so that the web server and the worker have what the page adds (a handler the
  commands trigger). Two things differ from a developer's terminal: the web server is this test's
  (``127.0.0.1:8000`` in a command is its address, and ``stack.stripe_trigger`` posts to it),
  and the commands in ``NOT_RUN`` are not run, for the reason given.

The package's README is run from its wheel, in a new project (tests/test_quickstart.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from stack.process import ROOT
from stack.smtp import SmtpServer
from stack.stripe_api import StripeApi
from tests.helpers import docblocks
from tests.helpers.processes import worker_env, worker_thread

DOCS = [ROOT / "docs" / "tutorial.md", *sorted((ROOT / "docs" / "how-to").glob("*.md"))]
BLOCKS = [block for doc in DOCS for block in docblocks.blocks(doc)]
CATCH_UP_SECONDS = 30

# Commands no test can run here, by how they start, with the reason.
NOT_RUN = {
    "docker compose": "needs Docker and builds images: tests/test_compose.py checks compose.yaml",
    "stripe ": "Stripe's CLI needs a Stripe account and the network",
}
TEST_SERVER = "http://127.0.0.1:8000"


def _where(blocks: list[docblocks.Block]) -> str:
    return ", ".join(f"{b.where} ({b.kind}: {b.target})" for b in blocks)


def test_every_block_says_what_it_is() -> None:
    unmarked = [
        block.where
        for block in BLOCKS
        if not (block.kind or block.language == "console")
        or (block.language == "python" and block.kind not in ("from", "example", "test"))
    ]
    assert not unmarked, f"blocks neither an excerpt, an example, a test nor commands: {unmarked}"


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.kind == "from"], ids=lambda block: block.where
)
def test_an_excerpt_is_in_the_file_it_quotes(block: docblocks.Block) -> None:
    assert (ROOT / block.target).is_file(), f"{block.where}: no file {block.target}"
    assert docblocks.quoted(block), f"{block.where}: not found, line for line, in {block.target}"


def _overlay(tree: Path, blocks: list[docblocks.Block]) -> list[Path]:
    """Write the page's examples and tests into ``tree``; the test files written."""
    texts: dict[str, str] = {}
    for block in blocks:
        if block.target not in texts:
            existing = ROOT / block.target
            texts[block.target] = existing.read_text() if existing.is_file() else ""
        # Two blank lines between the parts, as between top-level definitions.
        texts[block.target] += ("\n\n" if texts[block.target] else "") + block.text
    # The project's fixtures, as tests/ has them.
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    tests = []
    for target, text in texts.items():
        path = tree / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.name.startswith("test_"):
            tests.append(path)
    return tests


def _laid_over(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest ``args`` in a process of its own, ``tree`` laid over the application, on a
    database, key prefixes and virtual host of its own (tests/settings.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TEST_RUN_ID"))}
    env |= {"DOCS_OVERLAY": str(tree), "TEST_RUN_ID": f"docs{uuid.uuid4().hex[:8]}"}
    for name in ("CELERY_BROKER_URL", "CELERY_BROKER_KEY_PREFIX", "REDIS_KEY_PREFIX"):
        env.pop(name, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.helpers.docs_overlay",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if any(b.doc == d and b.kind in ("example", "test") for b in BLOCKS)],
    ids=lambda doc: str(doc.relative_to(ROOT)),
)
def test_a_pages_examples_pass_its_test(doc: Path, tmp_path: Path) -> None:
    blocks = [b for b in BLOCKS if b.doc == doc and b.kind in ("example", "test")]
    tree = tmp_path / "overlay"
    tests = _overlay(tree, blocks)
    if not tests:
        modules = [".".join(Path(b.target).with_suffix("").parts) for b in blocks]
        smoke = tree / "tests" / "test_examples_import.py"
        smoke.parent.mkdir(parents=True, exist_ok=True)
        smoke.write_text(
            "import importlib\n\n\ndef test_the_examples_import() -> None:\n"
            f"    for name in {sorted(set(modules))!r}:\n"
            "        assert importlib.import_module(name).__file__.startswith("
            f"{str(tree)!r})\n"
        )
        tests.append(smoke)
    run = _laid_over(tree, "--confcutdir", str(tree), *map(str, tests))
    assert run.returncode == 0, f"{_where(blocks)}:\n{run.stdout[-6000:]}{run.stderr[-3000:]}"


class Shell:
    """One bash for a page's commands, as a terminal is: a variable one command sets, the next
    reads. Each command's output is what it wrote, both streams, up to its exit status."""

    END = "@@docs-run-end"

    def __init__(self, env: dict[str, str]) -> None:
        self.bash = subprocess.Popen(
            ["bash"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run(self, command: str) -> tuple[int, str]:
        assert self.bash.stdin is not None
        assert self.bash.stdout is not None
        self.bash.stdin.write(f"{command}\nprintf '\\n{self.END} %s\\n' $?\n")
        self.bash.stdin.flush()
        lines: list[str] = []
        while True:
            line = self.bash.stdout.readline()
            assert line, f"the shell ended during {command!r}: {''.join(lines)}"
            if line.startswith(self.END):
                return int(line.split()[1]), "".join(lines)
            lines.append(line)

    def close(self) -> None:
        assert self.bash.stdin is not None
        assert self.bash.stdout is not None
        self.bash.stdin.close()
        self.bash.wait(timeout=10)
        self.bash.stdout.close()


def _not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


def _as_run(command: str, server: str) -> str:
    """The command against this test's web server."""
    command = command.replace(TEST_SERVER, server)
    if "-m stack.stripe_trigger" in command and "--url" not in command:
        command += f" --url {server}/webhooks/stripe/"
    return command


COMMAND_DOCS = [d for d in DOCS if any(b.doc == d and b.language == "console" for b in BLOCKS)]


@pytest.fixture
def running(live_server: Any, smtp: SmtpServer, stripe_api: StripeApi) -> Iterator[dict[str, str]]:
    """The set-up the pages start from (the README's "Try it by hand"): the tables, an
    ``admin``, the web app, a worker and an SMTP server, and the kit's stand-in of the Stripe
    API; the environment of its commands."""
    get_user_model().objects.create_superuser("admin", "admin@example.com", "admin")
    with worker_thread():
        yield {
            # tests/settings.py sets STRIPE_API_KEY empty: the stand-in's is a setting of its own,
            # its origin listed as trusted, as every process's start requires of a base that is
            # not Stripe's own.
            **worker_env(
                smtp.port,
                settings={
                    "STRIPE_API_KEY": stripe_api.key,
                    "STRIPE_API_BASE": stripe_api.url,
                    "PROVIDER_API_ALLOWED_ORIGINS": [stripe_api.url],
                },
            ),
            "DOCS_TEST_SERVER": live_server.url,
        }


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, reset_sequences=True)
@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_a_pages_commands_run_and_show_what_it_says(
    doc: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    examples = [b for b in BLOCKS if b.doc == doc and b.kind == "example"]
    if examples and "DOCS_OVERLAY" not in os.environ:
        # The page's commands act on its examples (a handler it adds): the web app and the worker
        # must have them, so this test runs again in a process laid over with them.
        tree = tmp_path / "overlay"
        _overlay(tree, examples)
        run = _laid_over(tree, f"{Path(__file__).relative_to(ROOT)}::{request.node.name}")
        assert run.returncode == 0, f"{_where(examples)}:\n{run.stdout[-6000:]}{run.stderr[-3000:]}"
        return
    running: dict[str, str] = request.getfixturevalue("running")
    shell = Shell(running)
    server = running["DOCS_TEST_SERVER"]
    try:
        for block in (b for b in BLOCKS if b.doc == doc and b.language == "console"):
            for command in docblocks.commands(block):
                where = f"{doc.relative_to(ROOT)}:{command.line}"
                if _not_run(command.text):
                    continue  # listed in NOT_RUN, with the reason
                deadline = time.monotonic() + (CATCH_UP_SECONDS if command.shown else 0)
                while True:
                    status, output = shell.run(_as_run(command.text, server))
                    missing = [s for s in command.shown if not docblocks.shown(s, output)]
                    if (status == 0 and not missing) or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                assert status == 0, f"{where}: exit status {status}\n{output}"
                assert not missing, f"{where}: not shown {missing}\n{output}"
    finally:
        shell.close()


def test_each_reason_not_to_run_names_commands_the_pages_have() -> None:
    """NOT_RUN stays the list of what is not run: an entry no command needs any more goes."""
    starts = [
        command.text
        for block in BLOCKS
        if block.language == "console"
        for command in docblocks.commands(block)
    ]
    unused = [start for start in NOT_RUN if not any(c.startswith(start) for c in starts)]
    assert not unused, unused
