"""The whole stack for the end-to-end benchmarks: an SMTP sink, Celery worker processes and
gunicorn, around one run's database and Redis prefix.

* ``SmtpSink``: aiosmtpd in this process (a thread and an event loop of its own). It accepts
  every message, optionally after a delay that each session awaits on its own (a slow provider
  answers many sessions slowly, it does not serialise them), and keeps the arrival time and the
  Message-ID of each: enough to count emails per invoice without parsing the message.
* ``celery_workers()``: ``celery -A core worker --include bench.tasks`` processes, each in its
  own process group, ready when each has set its key in Redis (``bench.tasks``); stopped with a
  warm shutdown (SIGTERM), then SIGKILL of the group, on the way out, on error or Ctrl-C too.
* ``serving()``: gunicorn through ``bench.harness.serve`` with the same environment.
* ``owned_run()``: what every benchmark owns for its duration: the benchmark database (under
  its advisory lock, recreated and migrated) and a Redis key prefix, deleted at the end.

Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol
from urllib.parse import urlsplit

import psycopg
import redis
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from bench.harness import HOST, GunicornConfig, Server, free_port, serve
from bench.stack import (
    ROOT,
    DatabaseBusy,
    database_exclusive,
    database_recreate,
    redis_prefix_delete,
    stack_pids,
)
from bench.tasks import NOOP_COUNTER, READY_KEY
from bench.webhook_ingest import NOOP_PATH, WEBHOOK_PATH, signed_requests
from webhooks import testing

RESULTS = ROOT / "bench" / "results"
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/invoicing_bench"
REDIS_URL = "redis://127.0.0.1:6379/13"

# Settings under which neither the throttle nor backpressure refuses the benchmark's own load.
# Both still run on every request (their cost is measured); only their thresholds move. Every
# sender is 127.0.0.1, which the default 6000/min per address would throttle as one flooding
# client; the marks would shed once a burst outruns the workers.
NO_LIMITS = {
    "WEBHOOK_THROTTLE_RATE": "1000000/min",
    "BACKPRESSURE_SOFT_MARK": "1000000000",
    "BACKPRESSURE_HARD_MARK": "1000000000",
}


# --- SMTP --------------------------------------------------------------------------------------

_MESSAGE_ID = re.compile(rb"^Message-ID:[ \t]*(<[^>\r\n]*>)", re.IGNORECASE | re.MULTILINE)


class SmtpSink:
    """An SMTP server that accepts everything, ``delay`` seconds after each DATA (awaited, so
    concurrent sessions wait side by side). ``delay`` may be changed while it runs."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay
        self.port = 0
        self._received = threading.Condition()
        self._times: list[float] = []
        self._ids: list[str] = []
        self._controller: Controller | None = None

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.delay > 0:
            await asyncio.sleep(self.delay)
        content = envelope.original_content or b""
        match = _MESSAGE_ID.search(content.partition(b"\r\n\r\n")[0])
        message_id = match.group(1).decode("ascii", "replace") if match else ""
        with self._received:
            self._times.append(time.perf_counter())
            self._ids.append(message_id)
            self._received.notify_all()
        return "250 Message accepted"

    @property
    def count(self) -> int:
        return len(self._ids)

    def time_of(self, number: int) -> float:
        """``time.perf_counter()`` when the ``number``-th message (from 1) arrived."""
        with self._received:
            return self._times[number - 1]

    def message_ids(self) -> list[str]:
        with self._received:
            return list(self._ids)

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` messages in all have arrived; False if they did not in time."""
        with self._received:
            return self._received.wait_for(lambda: len(self._ids) >= count, timeout=timeout)

    def start(self) -> SmtpSink:
        error: Exception | None = None
        for _ in range(5):  # another process may take the free port before we bind it
            port = free_port()
            controller = Controller(
                self, hostname=HOST, port=port, server_hostname="sink.bench.localhost"
            )
            try:
                controller.start()
            except Exception as exc:  # aiosmtpd wraps bind errors variously
                error = exc
                continue
            self._controller, self.port = controller, port
            return self
        raise RuntimeError(f"could not start the SMTP sink: {error!r}")

    def stop(self) -> None:
        if self._controller is not None:
            with contextlib.suppress(Exception):
                self._controller.stop()
            self._controller = None

    def __enter__(self) -> SmtpSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def provider_invoice_id(message_id: str) -> str:
    """The provider invoice id in an invoice email's Message-ID, ``<in_….<digest>@domain>``
    (``invoicing.services.invoice_email_message_id``)."""
    local = message_id.strip("<>").rpartition("@")[0]
    return local.rpartition(".")[0]


def emails_check(sink: SmtpSink, expected: Collection[str]) -> dict[str, Any]:
    """Exactly one email for each invoice in ``expected``, and none for any other."""
    received = Counter(provider_invoice_id(mid) for mid in sink.message_ids())
    wanted = set(expected)
    missing = len(wanted - received.keys())
    duplicated = sum(1 for invoice in wanted if received[invoice] > 1)
    unexpected = sum(n for invoice, n in received.items() if invoice not in wanted)
    return {
        "invoices": len(wanted),
        "emails": sink.count,
        "missing": missing,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "ok": missing == duplicated == unexpected == 0 and sink.count == len(wanted),
    }


# --- Celery workers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    processes: int = 1
    concurrency: int = 4
    pool: str = "prefork"

    def describe(self) -> str:
        return f"{self.processes} x celery worker -P {self.pool} -c {self.concurrency}"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (bounded by what ``/proc`` lists, no cycle possible)."""
    tree: list[int] = []
    pending = [pid]
    while pending and len(tree) < 10_000:
        current = pending.pop()
        tree.append(current)
        pending += _children(current)
    return tree


def _proc_field(path: str, name: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def rss_kib(pid: int) -> int | None:
    """Resident set size of one process, KiB (pages shared with other processes counted in
    full); None if it is gone."""
    return _proc_field(f"/proc/{pid}/status", "VmRSS:")


def pss_kib(pid: int) -> int | None:
    """Proportional set size of one process, KiB (each shared page divided among the
    processes sharing it: prefork pool processes share much of their parent's memory)."""
    return _proc_field(f"/proc/{pid}/smaps_rollup", "Pss:")


@dataclass
class Workers:
    processes: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def pids(self) -> list[int]:
        """Every worker's main process and its pool processes."""
        return [pid for process in self.processes for pid in process_tree(process.pid)]

    def rss(self) -> dict[int, int]:
        """RSS (KiB) of every worker process, main and pool."""
        sizes = {pid: rss_kib(pid) for pid in self.pids()}
        return {pid: size for pid, size in sizes.items() if size is not None}

    def pss(self) -> dict[int, int]:
        """PSS (KiB) of every worker process, main and pool."""
        sizes = {pid: pss_kib(pid) for pid in self.pids()}
        return {pid: size for pid, size in sizes.items() if size is not None}

    def check(self) -> None:
        """Raise if a worker has exited."""
        for process, log in zip(self.processes, self.logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(
                    f"celery worker exited with {process.returncode}:\n{_log_tail(log)}"
                )


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _workers_stop(processes: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Warm shutdown (SIGTERM: finish the running tasks) for all at once, then SIGKILL each
    whole process group, pool processes included."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def celery_workers(
    *,
    env: Mapping[str, str],
    config: WorkerConfig,
    run: str,
    redis_url: str,
    prefix: str,
    log_dir: Path,
    log_name: str,
    startup_timeout: float = 90.0,
    stop_grace: float = 15.0,
) -> Iterator[Workers]:
    """``config.processes`` workers named ``<run>-w<i>@<host>``, consuming the queues every
    ``celery -A core worker`` consumes, with ``bench.tasks`` loaded; each logs to
    ``<log_dir>/<log_name>.worker<i>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    client = redis.Redis.from_url(redis_url)
    try:
        for index in range(1, config.processes + 1):
            log = log_dir / f"{log_name}.worker{index}.log"
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "celery",
                            "-A",
                            "core",
                            "worker",
                            "-n",
                            f"{run}-w{index}@%h",
                            "-P",
                            config.pool,
                            "-c",
                            str(config.concurrency),
                            "--include",
                            "bench.tasks",
                            "--without-gossip",
                            "--without-mingle",
                            "--without-heartbeat",
                        ],
                        cwd=ROOT,
                        env=dict(env),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            logs.append(log)
        workers = Workers(processes=processes, logs=logs)
        deadline = time.monotonic() + startup_timeout
        pattern = f"{prefix}{READY_KEY}{run}-w*"
        while len(list(client.scan_iter(match=pattern, count=1000))) < config.processes:
            workers.check()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"celery workers not ready within {startup_timeout:.0f} s:\n"
                    + "\n".join(_log_tail(log) for log in logs)
                )
            time.sleep(0.2)
        yield workers
    finally:
        client.close()
        _workers_stop(processes, stop_grace)


def noop_done(client: redis.Redis, prefix: str) -> int:
    """How many ``bench.noop`` tasks have run in this run."""
    return int(client.get(prefix + NOOP_COUNTER) or 0)


# The application's relay schedule (core/jobs.py: every 15 s) and grace period
# (OUTBOX_RELAY_GRACE_SECONDS, 10 s by default), reproduced while a benchmark waits for emails.
RELAY_EVERY = 15.0
RELAY_GRACE = 10

# --- The run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """What one benchmark run owns and how it serves."""

    name: str  # the benchmark, for log file names
    prefix: str  # Redis keys, "bench-<random>:"
    database_url: str = DATABASE_URL
    redis_url: str = REDIS_URL
    gunicorn: GunicornConfig = field(default_factory=GunicornConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    secret: str = field(default_factory=lambda: f"whsec_bench_{secrets.token_hex(16)}")

    @property
    def database(self) -> str:
        return urlsplit(self.database_url).path.lstrip("/")

    @property
    def run_id(self) -> str:
        return self.prefix.rstrip(":")


class StackOptions(Protocol):
    """What every full-stack benchmark's options say about the stack (``stack_arguments``)."""

    database_url: str
    redis_url: str
    gunicorn: GunicornConfig
    workers: WorkerConfig
    output: Path


def stack_arguments(parser: argparse.ArgumentParser, *, name: str) -> None:
    """The options every full-stack benchmark takes: the stack's shape, its database and
    Redis, and where its results go (``bench/results/<name>.json``)."""
    parser.add_argument("--gunicorn-workers", type=int, default=3)
    parser.add_argument("--worker-processes", type=int, default=1, help="celery workers")
    parser.add_argument("--worker-concurrency", type=int, default=4, help="pool size of each")
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--output", type=Path, default=RESULTS / f"{name}.json")


def stack_fields(
    args: argparse.Namespace, *, gunicorn: GunicornConfig | None = None, pool: str = "prefork"
) -> dict[str, Any]:
    """The ``StackOptions`` fields from what ``stack_arguments`` parsed."""
    return {
        "gunicorn": gunicorn or GunicornConfig(workers=args.gunicorn_workers),
        "workers": WorkerConfig(
            processes=args.worker_processes, concurrency=args.worker_concurrency, pool=pool
        ),
        "database_url": args.database_url,
        "redis_url": args.redis_url,
        "output": args.output,
    }


def run_config(name: str, prefix: str, options: StackOptions) -> RunConfig:
    """The run a benchmark's ``measure`` owns, from its options."""
    return RunConfig(
        name=name,
        prefix=prefix,
        database_url=options.database_url,
        redis_url=options.redis_url,
        gunicorn=options.gunicorn,
        workers=options.workers,
    )


def stack_env(run: RunConfig, *, smtp_port: int, settings: Mapping[str, str]) -> dict[str, str]:
    """The environment of gunicorn and the workers: production settings (``DJANGO_DEBUG=0``)
    on loopback, the run's database, broker prefix and SMTP sink, then ``settings``."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "core.settings",
        "DJANGO_ROOT_URLCONF": "bench.urls",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_SECURE_SSL_REDIRECT": "0",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "LOG_LEVEL": "WARNING",
        "DATABASE_URL": run.database_url,
        "CELERY_BROKER_URL": run.redis_url,
        "CELERY_BROKER_KEY_PREFIX": run.prefix,
        "REDIS_URL": run.redis_url,
        "REDIS_KEY_PREFIX": run.run_id,  # cache keys become "<prefix>1:<key>"
        "STRIPE_WEBHOOK_SECRET": run.secret,
        # The senders sign test-mode events (webhooks/testing.py); production acts on live only.
        "STRIPE_LIVEMODE": "test",
        "EMAIL_HOST": HOST,
        "EMAIL_PORT": str(smtp_port),
        **settings,
    }


@dataclass
class Backend:
    """The SMTP sink and the Celery workers of a run, and the environment they share."""

    run: RunConfig
    sink: SmtpSink
    workers: Workers
    env: dict[str, str]
    redis: redis.Redis
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def wait_emails(self, total: int, timeout: float) -> None:
        """Wait until the sink has received ``total`` emails in all; raise after ``timeout``.

        Every ``RELAY_EVERY`` seconds meanwhile, look for outbox rows left unpublished for
        longer than ``RELAY_GRACE`` (an on-commit publish failed: the broker stalled or was
        unreachable, which a neighbour on the shared Redis can cause) and, if there are any,
        run the application's own relay, ``manage.py outbox relay``, as its scheduled job
        does in production (celery beat is not part of these benchmarks); each relay is
        recorded in ``incidents``: the run's figures then include a broker stall."""
        started = time.perf_counter()
        deadline = started + timeout
        next_check = started + RELAY_EVERY
        while not self.sink.wait_for(total, timeout=1.0):
            now = time.perf_counter()
            if now >= deadline:
                self.workers.check()
                raise RuntimeError(
                    f"{self.sink.count} of {total} emails after {timeout:.0f} s "
                    f"({stored(self.run.database_url)})"
                )
            if now >= next_check:
                self.workers.check()
                stranded = outbox_stranded(self.run.database_url, RELAY_GRACE)
                if stranded:
                    self.relay(stranded)
                next_check = now + RELAY_EVERY

    def relay(self, stranded: int) -> None:
        result = subprocess.run(
            [sys.executable, "manage.py", "outbox", "relay", "--grace", str(RELAY_GRACE)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = (result.stdout + result.stderr).strip().splitlines()
        incident = {
            "at": time.strftime("%H:%M:%S"),
            "what": f"{stranded} outbox row(s) unpublished for over {RELAY_GRACE} s "
            "(an on-commit publish failed); relayed",
            "relay": output[-1] if output else f"exit {result.returncode}",
        }
        self.incidents.append(incident)
        print(f"  WARNING: {incident['what']}: {incident['relay']}", flush=True)

    def cpu_groups(self, server: Server) -> dict[str, list[int]]:
        """Processes by group for ``bench.stack.cpu_snapshot``: ``client`` is this process,
        the load generator and the SMTP sink together."""
        groups = stack_pids(gunicorn=server.worker_pids(), database=self.run.database)
        return {**groups, "celery": self.workers.pids()}


@contextlib.contextmanager
def backend(
    run: RunConfig, *, settings: Mapping[str, str], smtp_delay: float = 0.0
) -> Iterator[Backend]:
    """The sink and the workers, stopped (workers first) on the way out."""
    client = redis.Redis.from_url(run.redis_url)
    try:
        with SmtpSink(delay=smtp_delay) as sink:
            env = stack_env(run, smtp_port=sink.port, settings=settings)
            with celery_workers(
                env=env,
                config=run.workers,
                run=run.run_id,
                redis_url=run.redis_url,
                prefix=run.prefix,
                log_dir=RESULTS,
                log_name=run.name,
            ) as workers:
                yield Backend(run=run, sink=sink, workers=workers, env=env, redis=client)
    finally:
        client.close()


@contextlib.contextmanager
def serving(
    backend: Backend, *, settings: Mapping[str, str] | None = None, log: str = ""
) -> Iterator[Server]:
    """gunicorn with the backend's environment (plus ``settings``), ready once a POST to the
    no-op view answers."""
    with serve(
        env={**backend.env, **(settings or {})},
        config=backend.run.gunicorn,
        log_path=RESULTS / f"{log or backend.run.name}.gunicorn.log",
        ready_path=NOOP_PATH,
    ) as server:
        yield server


@dataclass(frozen=True)
class Batch:
    """Signed ``invoice.paid`` deliveries, each for a new invoice, and those invoices' ids."""

    invoice_ids: list[str]
    requests: list[bytes]


def paid_batch(count: int, *, port: int, secret: str) -> Batch:
    """``count`` new paid invoices as Stripe deliveries, signed now (build just before use:
    the signature is valid for ``STRIPE_WEBHOOK_TOLERANCE``, 300 s by default)."""
    ids = [testing.new_id("in") for _ in range(count)]
    bodies = [
        testing.encode(testing.event("invoice.paid", testing.invoice_object(invoice_id=invoice)))
        for invoice in ids
    ]
    return Batch(
        invoice_ids=ids,
        requests=signed_requests(bodies, path=WEBHOOK_PATH, port=port, secret=secret),
    )


ACCEPTED_BODY = b'"duplicate": false'


def stored(database_url: str) -> dict[str, int]:
    """What the pipeline left in PostgreSQL."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            """
            SELECT (SELECT count(*) FROM webhooks_webhookevent),
                   (SELECT count(*) FROM invoicing_invoice),
                   (SELECT count(*) FROM core_outboxmessage),
                   (SELECT count(*) FROM core_outboxmessage WHERE published_at IS NULL),
                   (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sent'),
                   (SELECT count(*) FROM invoicing_emaildelivery WHERE state <> 'sent'),
                   (SELECT count(*) FROM core_deadletter)
            """
        ).fetchone()
    assert row is not None
    names = (
        "events",
        "invoices",
        "outbox",
        "outbox_unpublished",
        "emails_sent",
        "emails_not_sent",
        "dead_letters",
    )
    return dict(zip(names, (int(n) for n in row), strict=True))


def outbox_stranded(database_url: str, grace: float) -> int:
    """Outbox rows unpublished for longer than ``grace`` seconds."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT count(*) FROM core_outboxmessage WHERE published_at IS NULL "
            "AND created_at < now() - make_interval(secs => %s)",
            [grace],
        ).fetchone()
    return int(row[0]) if row else 0


def stored_invoice_ids(database_url: str) -> set[str]:
    with psycopg.connect(database_url) as connection:
        rows = connection.execute("SELECT provider_invoice_id FROM invoicing_invoice").fetchall()
    return {row[0] for row in rows}


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Unwind through every ``finally`` (processes stopped, keys deleted), as Ctrl-C does.
    raise KeyboardInterrupt


@contextlib.contextmanager
def owned_run(*, database_url: str, redis_url: str) -> Iterator[str]:
    """SIGTERM handled as Ctrl-C; the benchmark database held (``DatabaseBusy`` if another run
    holds it), recreated and migrated; a Redis prefix of the run's own, yielded, and every key
    under it deleted at the end."""
    signal.signal(signal.SIGTERM, _terminate)
    prefix = f"bench-{secrets.token_hex(6)}:"
    try:
        with database_exclusive(url=database_url):
            print(f"recreating {database_url} ...", flush=True)
            database_recreate(url=database_url)
            yield prefix
    finally:
        deleted = redis_prefix_delete(url=redis_url, prefix=prefix)
        print(f"deleted {deleted} Redis key(s) under {prefix}", flush=True)


def cpu_per_item(cpu: Mapping[str, float], items: int) -> dict[str, float]:
    """CPU milliseconds per item, by group."""
    return {
        group: seconds * 1000 / items if items else float("nan") for group, seconds in cpu.items()
    }


def owned_measure(
    options: StackOptions,
    measure: Callable[[Any, str], dict[str, Any]],
    *,
    benchmark: str,
    config: Mapping[str, Any],
) -> dict[str, Any] | int:
    """Run ``measure(options, prefix)`` inside ``owned_run`` and write its results to
    ``options.output`` with ``config`` (the stack's shape added); an exit status instead of
    results when it was interrupted (130) or another run holds the benchmark database (1)."""
    from bench.report import results_write

    started = time.time()
    try:
        with owned_run(database_url=options.database_url, redis_url=options.redis_url) as prefix:
            results = measure(options, prefix)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except DatabaseBusy as exc:
        print(f"not run: {exc}", file=sys.stderr)
        return 1
    results_write(
        options.output,
        benchmark=benchmark,
        started=started,
        results=results,
        config={
            "gunicorn": options.gunicorn.describe(),
            "workers": options.workers.describe(),
            **config,
        },
    )
    return results
