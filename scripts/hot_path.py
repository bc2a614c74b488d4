"""The paid invoice's path as it runs: the first-party modules, and how many of their lines, that
one paid invoice executes from the webhook to the SMTP server, measured on the real stack and
written into docs/explanation/hot-path.md (between ``<!-- hot-path:start -->`` and
``<!-- hot-path:end -->``).

    .venv/bin/python -m scripts.hot_path          # measure, rewrite the doc's block
    .venv/bin/python -m scripts.hot_path --check  # measure, exit 1 if the doc says otherwise

How it measures. A database of the run's own on the machine's PostgreSQL (created, migrated,
dropped), keys under a prefix of the run's own on the machine's Redis (deleted), an SMTP server
(``stack.smtp``), and the application's processes as the kit starts them (``stack.launch``), on
``core.settings`` with production's defaults: gunicorn with one sync worker, and a Celery worker
with one prefork pool process. Each loads ``scripts.hot_path_probe``, which starts coverage.py
in the thread that serves requests or runs tasks: gunicorn's worker, the Celery worker's main
process (messages in, acknowledgements out) and its pool process (the task). A paid invoice is
an ``invoice.paid`` event signed as Stripe signs it, posted over HTTP; it is done once its email
reached the SMTP server, its job finished and its message was acknowledged.

The first invoice warms everything (imports, connections, caches) under coverage's context
``warm``. ``PAUSE`` later, so that the second reads again what a process reuses for a second (the
backlog, the email breaker's state), a SIGUSR2 switches every process to the context ``measured``,
and each answers before the second invoice is posted; once that one is done, a second SIGUSR2 stops
coverage and saves its data. The lines recorded under ``measured`` are the second invoice's alone.
First-party means the application's apps (core, invoicing, webhooks) and the machinery's
package (packages/asyncwork/asyncwork). A module whose measured lines are all module-level
statements would only have been imported in the window: it is not counted, and the run says so.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import coverage
import psycopg
import redis

from stack import launch, stripe_events
from stack.net import HOST, wait_until
from stack.process import ROOT, ProcessError
from stack.smtp import SmtpServer

DOC = ROOT / "docs" / "explanation" / "hot-path.md"
START, END = "<!-- hot-path:start -->", "<!-- hot-path:end -->"
# The bound on the first-party modules one paid invoice runs through, every process together.
LIMIT = 15
# The processes measured, in the order a paid invoice crosses them.
PROCESSES = {
    "web": "gunicorn worker",
    "worker": "Celery worker (main)",
    "pool": "Celery worker (pool)",
}
# The machine's PostgreSQL (its postgres database, to create the run's own) and Redis.
POSTGRES = "postgres://postgres@127.0.0.1:5432/postgres"
BROKER_URL = "redis://127.0.0.1:6379/0"
CACHE_URL = "redis://127.0.0.1:6379/1"
TIMEOUT = 60.0
# Between the invoices: longer than every process's reuse of a reading (the backlog's,
# BACKPRESSURE_CHECK_SECONDS; the email breaker's, invoicing.tasks.BREAKER_CHECK_SECONDS; 1 s
# each), so the second invoice reads them anew, as an invoice arriving alone does, however
# loaded the machine.
PAUSE = 2.0
# The second invoice is done once the broker shows its message acknowledged (kombu's HDEL); the
# worker's acknowledgement still has its last statement to run then (asyncwork.broker.QoS.ack),
# so the lines are saved this much later, however loaded the machine.
SETTLE = 0.5
# What the processes' probe (scripts.hot_path_probe) measures, where it writes, and its phases.
SOURCE = ["core", "invoicing", "webhooks", "packages/asyncwork/asyncwork"]
DATA = "HOT_PATH_DATA"
WARM, MEASURED, SAVED = "warm", "measured", "saved"


@dataclass(frozen=True)
class Measurement:
    """For each process, the first-party modules it ran for the measured invoice and the lines
    it ran in each; where each module's file is."""

    lines: dict[str, dict[str, list[int]]]
    files: dict[str, Path]
    # Modules whose lines in the window were all module-level statements: imported, not counted.
    imported: list[str]

    def modules(self) -> list[str]:
        """By the first process that runs each (in the order the invoice reaches them), the
        application's before the machinery's, then by name."""
        order = list(PROCESSES)
        first: dict[str, int] = {}
        for process in reversed(order):
            first |= dict.fromkeys(self.lines[process], order.index(process))
        return sorted(
            first, key=lambda module: (first[module], module.startswith("asyncwork"), module)
        )

    def counts(self) -> dict[str, dict[str, int]]:
        """Module -> process -> how many of its lines ran there."""
        return {
            module: {
                process: len(found[module])
                for process, found in self.lines.items()
                if module in found
            }
            for module in self.modules()
        }

    def functions(self, module: str) -> list[str]:
        """The functions of ``module`` that ran, in any process, in the order of the file."""
        names = functions(self.files[module])
        ran = sorted({line for found in self.lines.values() for line in found.get(module, ())})
        return list(dict.fromkeys(names.get(line, "(module)") for line in ran))


def module_name(path: str) -> str:
    relative = Path(path).resolve().relative_to(ROOT).as_posix()
    return relative.removeprefix("packages/asyncwork/").removesuffix(".py").replace("/", ".")


def module_level(path: Path) -> set[int]:
    """The lines of ``path`` that importing it runs: its module-level statements and the
    statements of its classes' bodies, a ``def``'s or ``class``'s own lines (decorators
    included) but not a function's body."""

    def statements(body: list[ast.stmt]) -> Iterator[int]:
        for node in body:
            decorators = getattr(node, "decorator_list", [])
            first = min([node.lineno, *(decorator.lineno for decorator in decorators)])
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from range(first, node.body[0].lineno)
                if isinstance(node, ast.ClassDef):
                    yield from statements(node.body)
            else:
                yield from range(first, (node.end_lineno or node.lineno) + 1)

    return set(statements(ast.parse(path.read_text()).body))


def functions(path: Path) -> dict[int, str]:
    """Each line of a function's body in ``path``, to the function's qualified name (its
    innermost one: ``Class.method``, ``outer.inner``)."""
    found: dict[int, str] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{node.name}"
                if not isinstance(node, ast.ClassDef):
                    for line in range(node.body[0].lineno, (node.end_lineno or 0) + 1):
                        found[line] = name
                visit(node.body, f"{name}.")

    visit(ast.parse(path.read_text()).body, "")
    return found


def read(directory: Path) -> Measurement:
    """The ``measured`` lines of every process's coverage data in ``directory``."""
    lines: dict[str, dict[str, list[int]]] = {process: {} for process in PROCESSES}
    files: dict[str, Path] = {}
    imported: set[str] = set()
    for data_file in sorted(directory.glob("*.coverage")):
        process = data_file.name.partition("-")[0]
        data = coverage.CoverageData(basename=str(data_file))
        data.read()
        data.set_query_contexts([MEASURED])
        for path in data.measured_files():
            ran = set(data.lines(path) or ())
            if not ran:
                continue
            module = module_name(path)
            if ran <= module_level(Path(path)):
                imported.add(module)
                continue
            files[module] = Path(path)
            found = lines[process].setdefault(module, [])
            found[:] = sorted(set(found) | ran)
    return Measurement(lines, files, sorted(imported))


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A database of this run's own on the machine's PostgreSQL: its URL, for the block."""
    name = f"hot_path_{secrets.token_hex(4)}"
    with psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urllib.parse.urlparse(POSTGRES)._replace(path=f"/{name}").geturl()
    finally:
        with psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def redis_keys(prefix: str) -> Iterator[None]:
    """The block's keys, all under ``prefix``, deleted after it (and only those)."""
    try:
        yield
    finally:
        for url in (BROKER_URL, CACHE_URL):
            with redis.Redis.from_url(url) as client:
                keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
                if keys:
                    client.delete(*keys)


def environment(database_url: str, smtp_port: int, data: Path, prefix: str) -> dict[str, str]:
    """The processes' environment: production's settings, secrets made up for the run, the
    run's database and key prefixes, and nothing of the caller's but where programs are."""
    kept = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    return {
        **kept,
        "DJANGO_SETTINGS_MODULE": "core.settings",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "STRIPE_WEBHOOK_SECRET": f"whsec_hot_path_{secrets.token_hex(24)}",
        # Plain HTTP on loopback; the events are test-mode events.
        "DJANGO_SECURE_SSL_REDIRECT": "0",
        "STRIPE_LIVEMODE": "test",
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": BROKER_URL,
        "CELERY_BROKER_KEY_PREFIX": f"{prefix}:",
        "REDIS_URL": CACHE_URL,
        "REDIS_KEY_PREFIX": prefix,
        "EMAIL_HOST": HOST,
        "EMAIL_PORT": str(smtp_port),
        DATA: str(data),
    }


def phase(data: Path, name: str, pids: list[int] | None = None) -> list[int]:
    """Signal ``pids`` (none: the processes are starting) and wait until each process of the
    three kinds has entered phase ``name``; the pids that did."""
    for pid in pids or ():
        os.kill(pid, signal.SIGUSR2)

    def entered() -> list[int] | None:
        found = {path.stem: path for path in data.glob(f"*.{name}")}
        roles = {stem.partition("-")[0] for stem in found}
        if roles != set(PROCESSES) or (pids and len(found) < len(pids)):
            return None
        return [int(stem.partition("-")[2]) for stem in found]

    started = wait_until(entered, TIMEOUT)
    if not started:
        raise SystemExit(f"hot_path: the processes did not all enter {name!r} ({data})")
    return started


def invoice(env: dict[str, str], url: str, sink: SmtpServer, number: int) -> None:
    """Post a paid invoice's event, signed, and wait until it is done: its email received,
    every job finished and every message acknowledged."""
    body = stripe_events.encode(
        stripe_events.event(
            "invoice.paid", stripe_events.invoice_object(invoice_id=stripe_events.new_id("in"))
        )
    )
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Stripe-Signature": stripe_events.signature_header(body, env["STRIPE_WEBHOOK_SECRET"]),
        },
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # an error status raises
        answer = json.loads(response.read())
    if not sink.handler.wait_for(number, timeout=TIMEOUT):
        raise SystemExit(f"hot_path: no email for invoice {number} (the webhook said {answer})")
    unacked = f"{env['CELERY_BROKER_KEY_PREFIX']}unacked"  # kombu's index of what is delivered

    def done() -> bool:
        with psycopg.connect(env["DATABASE_URL"]) as conn:
            row = conn.execute("SELECT count(*) FROM asyncwork_job WHERE finished_at IS NULL")
            unfinished = row.fetchone()
        with redis.Redis.from_url(BROKER_URL) as broker:
            return unfinished == (0,) and broker.hlen(unacked) == 0

    if not wait_until(done, TIMEOUT):
        raise SystemExit(
            f"hot_path: invoice {number}'s job did not finish, or was not acknowledged"
        )


def migrate(env: dict[str, str]) -> None:
    """The run's database migrated, as the application's processes will find it."""
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "-v0"], env=env, cwd=ROOT, check=True
    )


def measure() -> Measurement:
    """Two paid invoices through the real processes; the second one's lines."""
    prefix = f"hot-path-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hot-path-")))
        database_url = stack.enter_context(database())
        stack.enter_context(redis_keys(prefix))
        sink = stack.enter_context(SmtpServer())
        env = environment(database_url, sink.port, data, prefix)
        migrate(env)
        stack.enter_context(
            launch.celery_worker(
                env,
                name=prefix,
                concurrency=1,
                include=["scripts.hot_path_probe"],
                log=data / "worker.log",
            )
        )
        web = stack.enter_context(
            launch.gunicorn(
                env,
                args=("-c", "python:scripts.hot_path_probe", "core.wsgi"),
                config=launch.GunicornConfig(workers=1),
                log=data / "web.log",
            )
        )
        url = f"http://{HOST}:{web.port}{launch.WEBHOOK_PATH}"
        pids = phase(data, WARM)
        invoice(env, url, sink, 1)
        time.sleep(PAUSE)
        phase(data, MEASURED, pids)
        invoice(env, url, sink, 2)
        time.sleep(SETTLE)
        phase(data, SAVED, pids)
        return read(data)


def render(found: Measurement) -> str:
    """The doc's block: the figures, then one row per module."""
    counts = found.counts()
    modules = found.modules()
    application = [module for module in modules if not module.startswith("asyncwork")]
    total = {
        process: sum(len(lines) for lines in found.lines[process].values()) for process in PROCESSES
    }
    rows = [
        f"One paid invoice runs **{len(modules)} first-party modules** "
        f"({len(application)} of the application, {len(modules) - len(application)} of the "
        f"machinery) and **{sum(total.values())} of their lines**: "
        + ", ".join(f"{total[process]} in {name}" for process, name in PROCESSES.items())
        + ".",
        "",
        "| Module | " + " | ".join(PROCESSES.values()) + " | Functions that ran |",
        "|---|" + "--:|" * len(PROCESSES) + "---|",
    ]
    for module in modules:
        cells = [str(counts[module].get(process, "")) for process in PROCESSES]
        names = ", ".join(f"`{name}`" for name in found.functions(module))
        rows.append(f"| `{module}` | " + " | ".join(cells) + f" | {names} |")
    return "\n".join(rows)


def block(text: str) -> str:
    """What ``text`` holds between the markers."""
    if START not in text or END not in text:
        raise SystemExit(f"hot_path: {DOC.relative_to(ROOT)} has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    check = parser.parse_args().check
    text = DOC.read_text()
    current = block(text)  # a doc without the markers stops the run before it measures
    try:
        found = measure()
    except (psycopg.Error, redis.RedisError, OSError, ProcessError) as exc:
        # PostgreSQL or Redis not answering, a process that did not start (its log's tail), the
        # webhook's refusal.
        raise SystemExit(f"hot_path: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"hot_path: the run's database could not be migrated: {exc}") from exc
    if found.imported:
        print(f"hot_path: only imported while measured, not counted: {', '.join(found.imported)}")
    measured = render(found)
    if measured == current:
        print(f"{DOC.relative_to(ROOT)} is up to date: {len(found.modules())} modules")
        return 0
    if check:
        print(f"{DOC.relative_to(ROOT)} is out of date (python -m scripts.hot_path); measured:")
        print(measured)
        return 1
    before, _, rest = text.partition(START)
    DOC.write_text(f"{before}{START}\n{measured}\n{END}{rest.partition(END)[2]}")
    print(f"{DOC.relative_to(ROOT)} rewritten: {len(found.modules())} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
