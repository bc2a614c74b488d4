"""The machine a run was made on, written into every benchmark and chaos result file.

A figure means nothing without the box that produced it: on two shared cores a rate moves
with the neighbours, so each result names the CPU model and count, the memory, the kernel,
Python, the PostgreSQL and Redis it ran against, and the load average when it started. Read
from ``/proc`` and the servers (or, for servers already stopped, their binaries); a part that
cannot be read is ``"unknown"``, never a guess.
"""

from __future__ import annotations

import glob
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from stack.process import ROOT

UNKNOWN = "unknown"


def _proc_field(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def _version_of(command: list[str]) -> str:
    """The first dotted version number a binary prints for ``--version``."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return UNKNOWN
    found = re.search(r"\d+\.\d+(?:\.\d+)?", out.stdout)
    return found.group(0) if found else UNKNOWN


def postgres_version(url: str | None = None) -> str:
    """The server's version when ``url``'s server answers (asked in its ``postgres`` database:
    ``url``'s own may not exist yet), else the newest installed server binary's."""
    if url:
        try:
            server = urlunsplit(urlsplit(url)._replace(path="/postgres"))
            with psycopg.connect(server, connect_timeout=5) as connection:
                row = connection.execute("SHOW server_version").fetchone()
                return str(row[0]).split()[0] if row else UNKNOWN
        except psycopg.Error:
            pass
    binaries = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4])
    )
    return _version_of([binaries[-1], "--version"]) if binaries else UNKNOWN


def redis_version(url: str | None = None) -> str:
    """The server's version when ``url`` answers, else ``redis-server --version``'s."""
    if url:
        client = redis.Redis.from_url(url, socket_timeout=5)
        try:
            return str(client.info("server")["redis_version"])
        except redis.RedisError:
            pass
        finally:
            client.close()
    return _version_of(["redis-server", "--version"])


def rabbitmq_version() -> str:
    """The installed RabbitMQ server's version (its library directory names it)."""
    found = sorted(glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*"))
    return found[-1].rpartition("rabbitmq_server-")[2] if found else UNKNOWN


def describe(
    *, postgres_url: str | None = None, redis_url: str | None = None, rabbitmq: bool = False
) -> dict[str, Any]:
    """CPU count and model, memory, kernel, Python, PostgreSQL and Redis (and RabbitMQ when
    the run used it), load at start."""
    memory = _proc_field("/proc/meminfo", "MemTotal:")
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan, math.nan, math.nan)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or UNKNOWN,
        "memory_gib": round(int(memory.split()[0]) / 1024 / 1024, 1) if memory else UNKNOWN,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": postgres_version(postgres_url),
        "redis": redis_version(redis_url),
        **({"rabbitmq": rabbitmq_version()} if rabbitmq else {}),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


def summary(machine: dict[str, Any]) -> str:
    """One line for a table's caption: ``<n> CPUs (<model>), <memory> GiB, Python <version>,
    PostgreSQL <version>, Redis <version>, load average at start <1-minute load>``."""
    return (
        f"{machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB, "
        f"Python {machine['python']}, PostgreSQL {machine.get('postgres', UNKNOWN)}, "
        f"Redis {machine.get('redis', UNKNOWN)}, "
        + (f"RabbitMQ {machine['rabbitmq']}, " if "rabbitmq" in machine else "")
        + "load average at start "
        f"{machine['loadavg_at_start'][0]}"
    )


def revision(root: Path = ROOT) -> str | None:
    """The checked-out commit, read from ``.git`` without running git (in a worktree too, where
    ``.git`` is a file naming its git directory); uncommitted changes are not visible here.
    None when it cannot be read."""
    try:
        git = root / ".git"
        if git.is_file():
            git = (root / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        for place in (git, common):
            if (place / ref).is_file():
                return (place / ref).read_text().strip()
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(f" {ref}"):
                return line.split()[0]
    except OSError:
        return None
    return None
