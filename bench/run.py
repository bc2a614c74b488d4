"""One benchmark run: what it owns, what its processes are given, and the CPU they spend.

* Ownership (``owned_run``, ``owned_measure``): the benchmark database, held under a PostgreSQL
  advisory lock for the run (another run is refused at once, ``DatabaseBusy``), dropped,
  recreated and migrated, so a run never reads or writes the development data and starts from
  empty tables; and a Redis key prefix of the run's own, every key under it deleted at the end
  (SCAN + DEL, never FLUSHDB). SIGTERM unwinds like Ctrl-C, through every ``finally``.
* The processes' environment (``stack_env``): production settings (``DJANGO_DEBUG=0``) on
  loopback, the run's database, broker prefix and secret; gunicorn serving it (``web``),
  ready once the no-op view answers.
* CPU seconds per process group (gunicorn, PostgreSQL, Redis, this process), from ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from bench.report import machine, results_write
from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST
from stack.process import ROOT, Process

RESULTS = ROOT / "bench" / "results"
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/invoicing_bench"
REDIS_URL = "redis://127.0.0.1:6379/13"
NOOP_PATH = "/bench/noop/"  # bench/urls.py: reads the body and answers, nothing else
TUTORIAL_PATH = "/bench/tutorial/webhook/"  # bench/tutorial.py: the tutorial arm's webhook

# Settings under which backpressure does not refuse the benchmark's own load. It still runs on
# every request (its cost is measured); only its marks move: they would shed once a burst
# outruns the workers (or, with no worker, as the email queue grows by one message per new
# event).
NO_LIMITS = {
    "BACKPRESSURE_SOFT_MARK": "1000000000",
    "BACKPRESSURE_HARD_MARK": "1000000000",
}


class DatabaseBusy(RuntimeError):
    """Another benchmark run holds the benchmark database."""


@contextlib.contextmanager
def database_exclusive(*, url: str) -> Iterator[None]:
    """Hold, for the block, a PostgreSQL advisory lock named after the database in ``url``;
    raise at once if another run holds it. Taken in the ``postgres`` database, as advisory locks
    are per database and the benchmark's own is about to be dropped."""
    parts = urlsplit(url)
    digest = hashlib.sha256(f"bench:{parts.path}".encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as lock:
        row = lock.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()
        if row is None or not row[0]:
            raise DatabaseBusy(f"another benchmark run is using {parts.path.lstrip('/')}")
        yield  # the lock goes with the connection


def database_recreate(*, url: str) -> None:
    """Drop the database named in ``url`` (closing its sessions), create it and migrate it."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if not name or name == "invoicing":
        raise ValueError(f"refusing to recreate database {name!r}: give the benchmark its own")
    connection = [
        f"--host={parts.hostname or '127.0.0.1'}",
        f"--port={parts.port or 5432}",
        f"--username={parts.username or 'postgres'}",
    ]
    subprocess.run(["dropdb", *connection, "--if-exists", "--force", name], check=True)
    subprocess.run(["createdb", *connection, name], check=True)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "--verbosity=0"],
        cwd=ROOT,
        env={
            **os.environ,
            "DATABASE_URL": url,
            # Production settings, as the benchmark serves them; migrate signs nothing, so
            # the secrets are throw-away.
            "DJANGO_SETTINGS_MODULE": "core.settings",
            "DJANGO_DEBUG": "0",
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
            "STRIPE_WEBHOOK_SECRET": f"whsec_bench_{secrets.token_hex(16)}",
        },
        check=True,
    )


def _prefixed_keys(client: redis.Redis, prefix: str) -> Iterable[bytes]:
    # The prefix is made of [a-z0-9:-]; nothing in it needs escaping for MATCH.
    return client.scan_iter(match=f"{prefix}*", count=1000)


def redis_queued(*, url: str, prefix: str) -> int:
    """Messages waiting in every list (Celery queue) under ``prefix``."""
    client = redis.Redis.from_url(url)
    try:
        return sum(
            client.llen(key)
            for key in _prefixed_keys(client, prefix)
            if client.type(key) == b"list"
        )
    finally:
        client.close()


def redis_prefix_delete(*, url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + DEL, never KEYS or FLUSHDB); return how many."""
    if not prefix:
        raise ValueError("refusing to delete every key: the prefix is empty")
    client = redis.Redis.from_url(url)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in _prefixed_keys(client, prefix):
            batch.append(key)
            if len(batch) == 500:
                deleted += client.delete(*batch)
                batch.clear()
        if batch:
            deleted += client.delete(*batch)
    finally:
        client.close()
    return deleted


_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of one process, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def pids_named(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return pids


def _machine_busy() -> float:
    """CPU seconds all cores spent on anything but idle and iowait since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / _TICKS


@dataclass(frozen=True)
class CpuSnapshot:
    per_group: Mapping[str, Mapping[int, float]]
    machine: float


def cpu_snapshot(groups: Mapping[str, Iterable[int]]) -> CpuSnapshot:
    """CPU seconds so far of each named group of processes, and of the whole machine."""
    per_group: dict[str, dict[int, float]] = {}
    for group, pids in groups.items():
        times = {pid: _process_cpu(pid) for pid in pids}
        per_group[group] = {pid: t for pid, t in times.items() if t is not None}
    return CpuSnapshot(per_group=per_group, machine=_machine_busy())


def cpu_spent(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds each group spent between two snapshots (a process that started in between
    counts from zero; one that ended in between is lost), ``all`` that the machine spent, and
    ``other`` for the rest: the kernel's own work (loopback TCP) and other users' processes."""
    spent = {
        group: sum(t - before.per_group.get(group, {}).get(pid, 0.0) for pid, t in times.items())
        for group, times in after.per_group.items()
    }
    machine = after.machine - before.machine
    return {**spent, "other": machine - sum(spent.values()), "all": machine}


# A client backend's title: "postgres: 15/main: <user> <database> <host>(<port>) <state>".
_CLIENT_BACKEND = re.compile(r"postgres: [^:]+: \S+ (\S+) (?:\S+\(\d+\)|\[local\])")


def _postgres_pids(database: str) -> list[int]:
    """The server's own processes (postmaster, WAL writer, checkpointer...) and the backends
    of ``database``; not the backends of other databases, which other users' work keeps busy."""
    pids = []
    for pid in pids_named("postgres"):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        backend = _CLIENT_BACKEND.match(title)
        if backend is None or backend.group(1) == database:
            pids.append(pid)
    return pids


@contextlib.contextmanager
def cpu_metered(
    groups: Callable[[], Mapping[str, Iterable[int]]], *, every: float = 1.0
) -> Iterator[dict[str, float]]:
    """Yield a dict that holds, once the block is over, what ``cpu_spent`` says the processes
    of ``groups()`` spent in it. The groups are listed afresh every ``every`` seconds meanwhile
    and each process's latest figure kept, so one that starts in the block counts from zero and
    one that ends in it counts until its last reading: a PostgreSQL backend, which Django
    replaces once its connection is ``CONN_MAX_AGE`` old, whatever the arm's length."""
    first = cpu_snapshot(groups())
    latest = {group: dict(times) for group, times in first.per_group.items()}
    done = threading.Event()

    def read() -> None:
        for group, times in cpu_snapshot(groups()).per_group.items():
            latest.setdefault(group, {}).update(times)

    def sample() -> None:
        while not done.wait(every):
            read()

    sampler = threading.Thread(target=sample, name="cpu-meter", daemon=True)
    sampler.start()
    spent: dict[str, float] = {}
    try:
        yield spent
    finally:
        done.set()
        sampler.join()
        read()
        spent.update(cpu_spent(first, CpuSnapshot(per_group=latest, machine=_machine_busy())))


def stack_pids(*, gunicorn: Iterable[int], database: str) -> dict[str, list[int]]:
    """The processes a webhook request runs through on this machine, by group. Redis is shared:
    its figure includes other users of the same server."""
    return {
        "gunicorn": list(gunicorn),
        "postgres": _postgres_pids(database),
        "redis": pids_named("redis-server"),
        "client": [os.getpid()],
    }


def cpu_per_item(cpu: Mapping[str, float], items: int) -> dict[str, float]:
    """CPU milliseconds per item, by group."""
    return {
        group: seconds * 1000 / items if items else float("nan") for group, seconds in cpu.items()
    }


# --- The run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    processes: int = 1
    concurrency: int = 4
    pool: str = "prefork"

    def describe(self) -> str:
        return f"{self.processes} x celery worker -P {self.pool} -c {self.concurrency}"


@dataclass(frozen=True)
class RunConfig:
    """What one benchmark run owns and how it serves."""

    name: str  # the benchmark, for log file names
    prefix: str  # Redis keys, "bench-<random>:"
    database_url: str = DATABASE_URL
    redis_url: str = REDIS_URL
    broker_url: str = ""  # the Celery broker, if not ``redis_url`` (RabbitMQ: bench.brokers)
    gunicorn: GunicornConfig = field(default_factory=GunicornConfig)
    workers: WorkerConfig = field(default_factory=WorkerConfig)
    secret: str = field(default_factory=lambda: f"whsec_bench_{secrets.token_hex(16)}")

    @property
    def database(self) -> str:
        return urlsplit(self.database_url).path.lstrip("/")

    @property
    def run_id(self) -> str:
        return self.prefix.rstrip(":")


@dataclass(frozen=True, kw_only=True)
class StackOptions:
    """What every benchmark's options say about the stack it runs; each benchmark's own
    options extend these."""

    gunicorn: GunicornConfig
    database_url: str
    redis_url: str
    output: Path


@dataclass(frozen=True, kw_only=True)
class FullStackOptions(StackOptions):
    """And the Celery workers, for the end-to-end benchmarks (``stack_arguments``)."""

    workers: WorkerConfig


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
    """The ``FullStackOptions`` fields from what ``stack_arguments`` parsed."""
    return {
        "gunicorn": gunicorn or GunicornConfig(workers=args.gunicorn_workers),
        "workers": WorkerConfig(
            processes=args.worker_processes, concurrency=args.worker_concurrency, pool=pool
        ),
        "database_url": args.database_url,
        "redis_url": args.redis_url,
        "output": args.output,
    }


def run_config(name: str, prefix: str, options: FullStackOptions) -> RunConfig:
    """The run a full-stack benchmark's ``measure`` owns, from its options."""
    return RunConfig(
        name=name,
        prefix=prefix,
        database_url=options.database_url,
        redis_url=options.redis_url,
        gunicorn=options.gunicorn,
        workers=options.workers,
    )


def stack_env(
    run: RunConfig, *, settings: Mapping[str, str], smtp_port: int | None = None
) -> dict[str, str]:
    """The environment of gunicorn and the workers: production settings (``DJANGO_DEBUG=0``)
    on loopback, the run's database, broker prefix and SMTP server, then ``settings``."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_SECURE_SSL_REDIRECT": "0",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "LOG_LEVEL": "WARNING",
        "DATABASE_URL": run.database_url,
        "CELERY_BROKER_URL": run.broker_url or run.redis_url,
        "CELERY_BROKER_KEY_PREFIX": run.prefix,
        "REDIS_URL": run.redis_url,
        "REDIS_KEY_PREFIX": run.run_id,  # cache keys become "<prefix>1:<key>"
        "STRIPE_WEBHOOK_SECRET": run.secret,
        # The senders sign test-mode events (stack/stripe_events.py); production acts on live only.
        "STRIPE_LIVEMODE": "test",
        **({"EMAIL_HOST": HOST, "EMAIL_PORT": str(smtp_port)} if smtp_port else {}),
        **settings,
    }


def web(env: Mapping[str, str], config: GunicornConfig, *, log: str) -> Process:
    """gunicorn with ``env``, logging to ``bench/results/<log>.gunicorn.log``; ready (with it)
    once a POST to the no-op view answers."""
    return launch.gunicorn(
        env,
        config=config,
        ready_path=NOOP_PATH,
        ready_status=200,
        ready_body=b"{}",
        log=RESULTS / f"{log}.gunicorn.log",
    )


def floor_web(env: Mapping[str, str], config: GunicornConfig, *, log: str) -> Process:
    """The floor receiver under gunicorn with the application's configuration and shape; ready
    once an unsigned POST is refused (400)."""
    return launch.gunicorn(
        env,
        args=("bench.floor_receiver",),
        config=config,
        ready_path=launch.WEBHOOK_PATH,
        ready_status=400,
        log=RESULTS / f"{log}.floor.gunicorn.log",
        name="gunicorn-floor",
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Unwind through every ``finally`` (processes stopped, keys deleted), as Ctrl-C does.
    raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    signal.signal(signal.SIGTERM, _terminate)


@contextlib.contextmanager
def owned_run(*, database_url: str, redis_url: str) -> Iterator[str]:
    """SIGTERM handled as Ctrl-C; the benchmark database held (``DatabaseBusy`` if another run
    holds it), recreated and migrated; a Redis prefix of the run's own, yielded, and every key
    under it deleted at the end."""
    sigterm_as_interrupt()
    prefix = f"bench-{secrets.token_hex(6)}:"
    try:
        with database_exclusive(url=database_url):
            print(f"recreating {database_url} ...", flush=True)
            database_recreate(url=database_url)
            yield prefix
    finally:
        deleted = redis_prefix_delete(url=redis_url, prefix=prefix)
        print(f"deleted {deleted} Redis key(s) under {prefix}", flush=True)


def owned_measure(
    options: StackOptions,
    measure: Callable[[Any, str], dict[str, Any]],
    *,
    benchmark: str,
    config: Mapping[str, Any],
) -> dict[str, Any] | int:
    """Run ``measure(options, prefix)`` inside ``owned_run`` and write its results to
    ``options.output`` with ``config`` (after gunicorn's shape); an exit status instead of
    results when it was interrupted (130) or another run holds the benchmark database (1)."""
    started = time.time()
    host = machine(postgres_url=options.database_url, redis_url=options.redis_url)
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
        config={"gunicorn": options.gunicorn.describe(), **config},
        host=host,
    )
    return results


def verdict(options: StackOptions, checks: Mapping[str, Any], *, failures: str = "") -> int:
    """The end of a benchmark's output: what it found stored (and sent), where its results
    are, and what failed (``failures``, or a stored state other than expected); its exit
    status."""
    sink = f"; sink {checks['sink']}" if "sink" in checks else ""
    print(f"stored state {'OK' if checks['ok'] else 'WRONG'}: {checks['found']}{sink}")
    print(f"\nresults: {options.output}")
    if failures:
        print(f"FAILED: {failures}", file=sys.stderr)
    if not checks["ok"]:
        print(f"FAILED: stored state expected {checks['expected']}", file=sys.stderr)
    return 1 if failures or not checks["ok"] else 0
