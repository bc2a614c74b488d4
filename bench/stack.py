"""What a benchmark sets up and checks around the server: its own database, its own broker keys,
and the CPU each part of the stack spent.

The benchmark database is dropped and recreated on every run, so a run never reads or writes
the development data and always starts from empty tables. Broker and cache keys carry a prefix
unique to the run and are deleted at the end. CPU is read from ``/proc`` (Linux only).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent


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


@dataclass(frozen=True)
class StoredCounts:
    """What the webhook path left in PostgreSQL."""

    events: int
    invoices: int
    outbox: int
    outbox_unpublished: int


def database_counts(*, url: str) -> StoredCounts:
    with psycopg.connect(url) as connection:
        row = connection.execute(
            """
            SELECT (SELECT count(*) FROM webhooks_webhookevent),
                   (SELECT count(*) FROM invoicing_invoice),
                   (SELECT count(*) FROM core_outboxmessage),
                   (SELECT count(*) FROM core_outboxmessage WHERE published_at IS NULL)
            """
        ).fetchone()
    assert row is not None
    return StoredCounts(*row)


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


def _pids_named(name: str) -> list[int]:
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
    for pid in _pids_named("postgres"):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
        backend = _CLIENT_BACKEND.match(title)
        if backend is None or backend.group(1) == database:
            pids.append(pid)
    return pids


def stack_pids(*, gunicorn: Iterable[int], database: str) -> dict[str, list[int]]:
    """The processes a webhook request runs through on this machine, by group. Redis is shared:
    its figure includes other users of the same server."""
    return {
        "gunicorn": list(gunicorn),
        "postgres": _postgres_pids(database),
        "redis": _pids_named("redis-server"),
        "client": [os.getpid()],
    }
