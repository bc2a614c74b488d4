"""The demo's fallback when the configured PostgreSQL or Redis does not answer.

The guarantees this application demonstrates are built on PostgreSQL (INSERT ... ON CONFLICT,
advisory locks, FOR UPDATE SKIP LOCKED) and on Redis (the broker, and Lua scripts for the
circuit breaker). A fallback to SQLite and a file-system broker would run a
second code path with weaker guarantees, so the demo would show something the application does
not do. The fallback runs the same engines, embedded in the demo instead:

* PostgreSQL 16 from the ``pgserver`` wheel, in a throw-away data directory, listening on a Unix
  socket only (run as root, pgserver creates and uses a ``pgserver`` system user, since
  PostgreSQL refuses to run as root);
* a Redis-protocol server from ``fakeredis`` (Lua through ``lupa``) on a free local port, in a
  thread of the demo process.

Each is started only for the service that does not answer, the demo says so, and both are
stopped and deleted when it ends. Both wheels are in the ``dev`` extra, which ``make demo``
installs. They are for a first look on a laptop, not for running the application: nothing is
kept, and fakeredis keeps everything in the demo's memory.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROBE_TIMEOUT = 1.0


def answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (or a Unix socket at ``host``)."""
    family, address = socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port)
    if host.startswith("/"):
        family, address = socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"  # type: ignore[assignment]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT)
        try:
            probe.connect(address)
        except OSError:
            return False
    return True


def database_answers(database: dict[str, Any]) -> bool:
    host = database.get("HOST") or database.get("OPTIONS", {}).get("host") or "127.0.0.1"
    return answers(host, int(database.get("PORT") or 5432))


def redis_answers(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return answers(parts.hostname or "127.0.0.1", parts.port or 6379)


@contextlib.contextmanager
def embedded_postgres(directory: Path, name: str) -> Iterator[str]:
    """Start PostgreSQL in ``directory``; yield a DATABASE_URL for database ``name`` on it."""
    with warnings.catch_warnings():  # it looks for a socket directory; ours is ``directory``
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import pgserver

        server = pgserver.get_server(directory, cleanup_mode="delete")
    try:
        socket_dir = urllib.parse.parse_qs(urllib.parse.urlsplit(server.get_uri()).query)["host"][0]
        yield f"postgres://postgres@/{name}?host={urllib.parse.quote(socket_dir)}"
    finally:
        server.cleanup()


@contextlib.contextmanager
def embedded_redis() -> Iterator[str]:
    """Serve the Redis protocol on a free local port from this process; yield its address."""
    from fakeredis import TcpFakeServer

    server = TcpFakeServer(("127.0.0.1", 0), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def with_netloc(url: str, netloc: str) -> str:
    """``url`` with its host and port replaced, keeping scheme, database number and options."""
    return urllib.parse.urlsplit(url)._replace(netloc=netloc).geturl()
