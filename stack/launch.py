"""The application's processes, started the one way every tool starts them: gunicorn, a Celery
worker, Celery beat and the nginx edge, each one function that takes the environment and the
few options that differ and returns a started ``Process`` (``with`` it: ready inside the
block, stopped after). Nothing else in the repository builds their command lines
(``tests/stack/test_launch.py`` checks it).

Readiness is a real answer, never an open port alone: gunicorn listens before its workers
have loaded the application, so it is ready once a request gets Django's answer; a worker
once it logs " ready." (or the caller's own test); the edge once it accepts connections.
gunicorn is given a socket this process bound, so no other process can take its port
between choosing and binding it.

``worker_thread`` is the second way to run a worker: in the caller's process, on threads,
consuming the real broker (Celery's own test worker), for tests that need a worker and the
caller's database connection and signals.
"""

from __future__ import annotations

import contextlib
import http.client
import shutil
import signal
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import TestWorkController, start_worker

from stack import nginx
from stack.net import HOST, free_port
from stack.process import Process, Ready

WEBHOOK_PATH = "/webhooks/stripe/"


def _logged(process: Process, line: str) -> bool:
    return line in process.log_text()


def celery_worker(
    env: Mapping[str, str],
    *,
    name: str,
    app: str = "core",
    concurrency: int = 1,
    pool: str | None = None,
    include: Sequence[str] = (),
    loglevel: str = "INFO",
    log: Path | None = None,
    append: bool = False,
    ready: Ready | None = None,
    via: Sequence[str] = (),
) -> Process:
    """``celery -A core worker`` (``app``: another Celery app's module) named ``<name>@<host>``,
    with ``concurrency`` pool processes (``pool``: Celery's default, prefork, unless given), the
    modules in ``include`` loaded too, without gossip, mingle or heartbeats (a worker here needs
    no other worker). Ready once it logs " ready." (logged at INFO: ``loglevel`` or
    ``LOG_LEVEL``), unless ``ready`` says otherwise. ``via`` is a command it is run through
    (another host: ``stack.netns``)."""
    return Process(
        [
            *via,
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-n",
            f"{name}@%h",
            *(("-P", pool) if pool else ()),
            "-c",
            str(concurrency),
            *(("--include", ",".join(include)) if include else ()),
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            loglevel,
        ],
        name=name,
        env=env,
        log=log,
        append=append,
        ready=ready or (lambda process: _logged(process, " ready.")),
    )


def celery_beat(
    env: Mapping[str, str],
    *,
    name: str = "beat",
    loglevel: str = "INFO",
    log: Path | None = None,
    append: bool = False,
    via: Sequence[str] = (),
) -> Process:
    """``celery -A core beat`` (the project's leader-locked database scheduler: no schedule
    file, no pid file). Ready once it logs that it started (at INFO). ``via``: as for
    ``celery_worker``."""
    return Process(
        [*via, sys.executable, "-m", "celery", "-A", "core", "beat", "-l", loglevel],
        name=name,
        env=env,
        log=log,
        append=append,
        ready=lambda process: _logged(process, "beat: Starting"),
    )


class _ThreadWorker(TestWorkController):
    """Celery's test worker, whose event loop wakes twice a second: it notices the end of the
    block at once. Its loop polls the broker connection for as long as its next timer is away,
    up to 10 s; on Redis the transport keeps timers of its own, on RabbitMQ there are none."""

    def register_with_event_loop(self, hub: Any) -> None:
        super().register_with_event_loop(hub)
        hub.call_repeatedly(0.5, lambda: None)


@contextlib.contextmanager
def worker_thread(app: Celery, *, concurrency: int = 2) -> Iterator[None]:
    """A real worker of ``app`` consuming the real broker, in this process (threads pool),
    for the block; it finishes what it runs before the block ends (30 s at most)."""
    app.loader.import_default_modules()
    with start_worker(
        app,
        pool="threads",
        concurrency=concurrency,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
        WorkController=_ThreadWorker,
    ):
        yield


@dataclass(frozen=True)
class GunicornConfig:
    """The options of gunicorn's that the tools choose; everything else is the project's
    configuration (``./gunicorn.conf.py``)."""

    worker_class: str = "sync"
    workers: int = 3
    threads: int = 1
    timeout: int = 30

    def argv(self) -> list[str]:
        return [
            f"--worker-class={self.worker_class}",
            f"--workers={self.workers}",
            f"--threads={self.threads}",
            f"--timeout={self.timeout}",
        ]

    def describe(self) -> str:
        threads = f" x {self.threads} threads" if self.worker_class == "gthread" else ""
        return f"{self.worker_class}, {self.workers} workers{threads}"


def http_status(
    port: int, path: str, *, body: bytes = b"", timeout: float = 2.0, host: str = HOST
) -> int:
    """The status of a POST of ``body`` to ``path`` on ``host``:``port``; 0 without an
    answer."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("POST", path, body=body)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        connection.close()


def gunicorn(
    env: Mapping[str, str],
    *,
    args: Sequence[str] = ("core.wsgi",),
    config: GunicornConfig | None = None,
    ready_path: str = WEBHOOK_PATH,
    ready_status: int | None = 400,
    ready_body: bytes = b"",
    log: Path | None = None,
    name: str = "gunicorn",
    host: str = HOST,
    port: int = 0,
    via: Sequence[str] = (),
) -> Process:
    """``gunicorn <args>`` (``config``'s options if given, else the configuration file's) on
    a socket bound here on ``host``; its port is the process's ``port``. Ready once a POST of
    ``ready_body`` to ``ready_path`` is answered ``ready_status`` (any status if None): an
    unsigned webhook answered 400 is Django's answer. On another host (``stack.netns``) it is
    called inside that host's namespace (the socket is made there) with ``via`` its
    ``ip netns exec``; ``port`` is a port of its own (a free one unless given)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        port = int(listener.getsockname()[1])

        def answered(process: Process) -> bool:
            status = http_status(port, ready_path, body=ready_body, host=host)
            return status == ready_status if ready_status is not None else status != 0

        return Process(
            [
                *via,
                sys.executable,
                "-m",
                "gunicorn",
                *args,
                f"--bind=fd://{listener.fileno()}",
                *(config.argv() if config else ()),
                "--no-control-socket",
                "--log-level=warning",
            ],
            name=name,
            env=env,
            log=log,
            ready=answered,
            pass_fds=(listener.fileno(),),
            port=port,
        )


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
        return True
    return False


def edge(
    upstream_port: int,
    *,
    rate: int,
    burst: int,
    in_flight: int,
    webhook_port: int | None = None,
    settings: nginx.Settings | None = None,
    name: str = "edge",
    upstream_host: str = HOST,
    via: Sequence[str] = (),
) -> Process:
    """nginx on a free port of ``HOST`` in front of ``upstream_host``:``upstream_port`` (every
    path) and ``upstream_host``:``webhook_port`` (the webhook; the same gunicorn unless given),
    configured by ``deploy/nginx/render.sh`` (``stack.nginx``): ``rate`` webhooks per second in
    all (``burst`` at once), ``in_flight`` at a time, any address may post webhooks, and any
    other of render.sh's settings in ``settings`` (the per-address ones derive from these as
    render.sh's header says). Stopped gracefully (SIGQUIT: what is in flight is answered).
    ``upstream_host`` may be a name that resolves to several addresses: nginx balances over them
    (across hosts, ``via`` runs it where the name is known: ``stack.netns.Topology.hosts_file``).
    """
    port = free_port()
    prefix = nginx.prefix_make(
        {
            "WEBHOOK_EDGE_RATE": rate,
            "WEBHOOK_EDGE_BURST": burst,
            "WEBHOOK_EDGE_CONNECTIONS": in_flight,
            "APP_UPSTREAM": f"{upstream_host}:{upstream_port}",
            "WEBHOOK_UPSTREAM": f"{upstream_host}:{webhook_port or upstream_port}",
            "WEBHOOK_ALLOWED_SOURCES": "any",
            "EDGE_LISTEN": f"{HOST}:{port}",
            "EDGE_CAPACITY_LISTEN": f"{HOST}:{free_port()}",
            **(settings or {}),
        }
    )
    try:
        return Process(
            [*via, *nginx.nginx_argv(prefix)],
            name=name,
            env={},
            log=prefix / f"{name}.log",
            ready=lambda process: _accepts(port),
            stop_signal=signal.SIGQUIT,
            port=port,
            owns=prefix,
        )
    except BaseException:
        shutil.rmtree(prefix, ignore_errors=True)
        raise
