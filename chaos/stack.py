"""The suite's own PostgreSQL and Redis, and the application's processes running on them.

Isolation. The faults restart Redis and PostgreSQL; doing that to the machine's shared
instances (127.0.0.1:5432 and :6379) would break every other user's work, so each arm of the
suite runs its own: a PostgreSQL cluster ``initdb``-ed into a temporary directory (owned by
the ``postgres`` OS user, since ``initdb`` refuses root) and started with ``pg_ctl`` on a free
loopback port with trust authentication and its socket in that directory, and a
``redis-server`` on a free loopback port with no persistence (``--save "" --appendonly no``),
as on this machine, so a restart drops every queued message. They are the same binaries as
the machine's instances, on loopback only.

Every process started here (gunicorn, the Celery workers, beat, redis-server) runs in a
process group of its own, so a kill takes the whole process (a Celery worker's pool children
too). ``Stack`` is a context manager: on the way out, on an error or Ctrl-C too, it stops
every process it started, stops PostgreSQL and removes the temporary directories.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_until(
    what: str, predicate: Callable[[], object], timeout: float, interval: float = 0.1
) -> None:
    """Call ``predicate`` until it returns something true; raise after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


class Service:
    """One child process in a process group of its own, its output in a log file (with
    ``pipes``, its stdin and stdout are pipes to the orchestrator and only stderr is logged).
    A ``supervised`` one is started again if it exits by itself (``Processes``)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str],
        log_dir: Path,
        pipes: bool = False,
        supervised: bool = False,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.supervised = supervised
        self.log = log_dir / f"{name}.log"
        self.ended_on_purpose = False
        self.replaced_by: Service | None = None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - our own argv, no shell
                argv,
                cwd=ROOT,
                env=dict(env),
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else out,
                stderr=out if pipes else subprocess.STDOUT,
                text=pipes,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def current(self) -> Service:
        """This service, or the one the supervisor started in its place."""
        service = self
        while service.replaced_by is not None:
            service = service.replaced_by
        return service

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process in this service's process group (a worker's pool children too)."""
        found = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(stat).read_text().rpartition(")")[2].split()
                if int(fields[2]) == self.pid:  # the process group id
                    found.append(int(stat.split("/")[2]))
        return found

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the leader."""
        self.ended_on_purpose = True
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after ``grace`` seconds."""
        self.ended_on_purpose = True
        if self.alive():
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass(frozen=True)
class Exit:
    """A process that exited by itself."""

    process: str
    exit_code: int | None
    at: float  # time.time(), when the supervisor saw it
    restarted: bool


class Processes:
    """Every process the suite starts, so that one call stops them all, and none starts
    after that (a fault injector may be restarting one while the run is being torn down).

    Supervision: a supervised process (the workers, beat) that exits by itself is recorded
    and started again after ``RESTART_DELAY`` seconds, as the deployment's process manager
    does (``restart: unless-stopped`` in compose.yaml). Nothing stops an application process
    except the faults, which say so, and the teardown: every exit recorded here is a
    process that died of a fault it should have survived."""

    RESTART_DELAY = 1.0

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._lock = threading.Lock()
        self._services: list[Service] = []
        self._exits: list[Exit] = []
        self._closed = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: Mapping[str, str],
        pipes: bool = False,
        supervised: bool = False,
    ) -> Service:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"not starting {name}: the run is being torn down")
            service = Service(
                name, argv, env=env, log_dir=self.log_dir, pipes=pipes, supervised=supervised
            )
            self._services.append(service)
            return service

    def _supervise(self) -> None:
        while not self._closed.wait(0.5):
            with self._lock:
                dead = [
                    s
                    for s in self._services
                    if s.replaced_by is None
                    and not s.ended_on_purpose
                    and s.proc.poll() is not None
                ]
            for service in dead:
                service.ended_on_purpose = True  # recorded once
                with self._lock:
                    self._exits.append(
                        Exit(service.name, service.proc.returncode, time.time(), service.supervised)
                    )
                if service.supervised and not self._closed.wait(self.RESTART_DELAY):
                    with contextlib.suppress(RuntimeError):  # torn down meanwhile
                        service.replaced_by = self.spawn(
                            service.name, service.argv, env=service.env, supervised=True
                        )

    def unexpected_exits(self) -> list[Exit]:
        """The processes that exited by themselves."""
        with self._lock:
            return list(self._exits)

    def stop_all(self) -> None:
        with self._lock:
            self._closed.set()
            services = list(reversed(self._services))
        self._supervisor.join(5)
        for service in services:
            service.stop(grace=5)


def _as_postgres() -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _pg_bindir() -> Path:
    configured = os.environ.get("CHAOS_PG_BINDIR")
    if configured:
        return Path(configured)
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[4]))
    if not candidates:
        raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql; set CHAOS_PG_BINDIR")
    return Path(candidates[-1])


class Postgres:
    """A throw-away PostgreSQL cluster on a free loopback port, trust authentication."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        self.bindir = _pg_bindir()
        self.logfile = root / "postgres.log"
        root.mkdir()
        if os.geteuid() == 0:
            root.parent.chmod(0o711)  # postgres may pass through, not list
            shutil.chown(root, user="postgres")
        self._pg(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(  # noqa: S603 - our own argv, no shell
            [*_as_postgres(), str(self.bindir / tool), *args],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # the postmaster inherits these: never a pipe
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=120,
        )

    def url(self, database: str) -> str:
        return f"postgres://postgres@{HOST}:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses={HOST} -c max_connections=200"
        self._pg(
            "pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-o", options, "start"
        )

    def restart(self) -> None:
        """A fast shutdown (every session is cut) and a start; returns once it accepts again."""
        self._pg("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "restart")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._pg("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")

    def create_database(self, name: str) -> None:
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


class RedisServer:
    """A redis-server on a free loopback port with no persistence, restartable on that port."""

    def __init__(self, root: Path, processes: Processes) -> None:
        self.dir = root / "redis"
        self.dir.mkdir()
        self.port = free_port()
        self.processes = processes
        self.service: Service | None = None
        self.generation = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, socket_timeout=timeout)

    def start(self) -> None:
        self.generation += 1
        argv = [
            "redis-server",
            "--bind",
            HOST,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
        ]
        self.service = self.processes.spawn(f"redis-{self.generation}", argv, env=os.environ)
        wait_until("redis", lambda: self.client(0.5).ping(), timeout=20)

    def shutdown_nosave(self) -> None:
        """``SHUTDOWN NOSAVE``: everything in memory (every queued message) is gone."""
        if self.service is not None:
            self.service.ended_on_purpose = True
        with contextlib.suppress(redis.RedisError):
            self.client().shutdown(nosave=True)
        if self.service is not None:
            try:
                self.service.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.service.kill()


class Stack:
    """PostgreSQL, Redis and the application's processes for one arm of the suite."""

    def __init__(self, *, log_dir: Path, app_env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.app_env = dict(app_env)
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.postgres: Postgres | None = None
        self.redis: RedisServer | None = None
        self.processes = Processes(log_dir)

    def __enter__(self) -> Stack:
        try:
            self.postgres = Postgres(self.tmp / "pg")
            self.postgres.start()
            self.redis = RedisServer(self.tmp, self.processes)
            self.redis.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.processes.stop_all()
        if self.postgres is not None:
            self.postgres.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the application ---------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The application's environment: the arm's settings plus this stack's addresses."""
        assert self.postgres is not None
        assert self.redis is not None
        return {
            **self.app_env,
            "DATABASE_URL": self.postgres.url("chaos"),
            "CELERY_BROKER_URL": f"{self.redis.url}/0",
            "REDIS_URL": f"{self.redis.url}/1",
            **extra,
        }

    def manage(self, *args: str) -> None:
        subprocess.run(  # noqa: S603 - our own argv, no shell
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.env(),
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            timeout=300,
        )

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        pipes: bool = False,
        supervised: bool = False,
        **extra_env: str,
    ) -> Service:
        return self.processes.spawn(
            name, argv, env=self.env(**extra_env), pipes=pipes, supervised=supervised
        )

    def start_worker(self, name: str, *, concurrency: int, settings_module: str) -> Service:
        """``celery -A core worker`` in a process group of its own; returns once it is ready."""
        service = self.start(
            name,
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "core",
                "worker",
                "-n",
                f"{name}@%h",
                "-c",
                str(concurrency),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
            supervised=True,
            DJANGO_SETTINGS_MODULE=settings_module,
            # The " ready." line is logged at INFO, and the application's logging settings
            # (not Celery's -l) decide what a worker logs.
            LOG_LEVEL="INFO",
        )
        wait_until(f"worker {name}", lambda: " ready." in service.log_text(), timeout=60)
        return service

    def start_beat(self) -> Service:
        return self.start(
            "beat",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "core",
                "beat",
                "-l",
                "WARNING",
                "--pidfile=",
                "-s",
                str(self.tmp / "beat-schedule"),
            ],
            supervised=True,
        )

    @contextlib.contextmanager
    def web(self, *, workers: int) -> Iterator[int]:
        """gunicorn core.wsgi (bench.harness.serve: its own socket, ready-checked); the port."""
        from bench.harness import GunicornConfig, serve

        with serve(
            env=self.env(),
            config=GunicornConfig(workers=workers, timeout=30),
            log_path=self.log_dir / "gunicorn.log",
            ready_path="/webhooks/stripe/",
            ready_status=400,  # no signature: Django answered, the app is loaded
        ) as server:
            yield server.port


class WorkerPool:
    """``count`` Celery workers, each in a process group of its own, restartable by index."""

    def __init__(self, stack: Stack, *, count: int, concurrency: int, settings_module: str) -> None:
        self.stack = stack
        self.concurrency = concurrency
        self.settings_module = settings_module
        self._services: list[Service] = []
        self.starts = 0
        for index in range(count):
            self._services.append(self._start(index))

    def __len__(self) -> int:
        return len(self._services)

    def service(self, index: int) -> Service:
        """The worker at ``index`` now (the supervisor may have started it again)."""
        return self._services[index].current()

    def _start(self, index: int) -> Service:
        self.starts += 1
        return self.stack.start_worker(
            f"worker{index + 1}-{self.starts}",
            concurrency=self.concurrency,
            settings_module=self.settings_module,
        )

    def restart(self, index: int) -> Service:
        self._services[index] = self._start(index)
        return self._services[index]

    def pid_index(self) -> dict[int, int]:
        """Every live worker process (parents and pool children) -> its worker's index."""
        return {pid: i for i in range(len(self)) for pid in self.service(i).pids()}


def tcp_ports(pids: list[int]) -> dict[int, int]:
    """The local port of every TCP socket held by one of ``pids`` -> the pid holding it. The
    client end of an SMTP session is the port the server sees in ``session.peer``."""
    port_of_inode: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                port_of_inode[f"socket:[{fields[9]}]"] = int(fields[1].rpartition(":")[2], 16)
    owned: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    port = port_of_inode.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    if port is not None:
                        owned[port] = pid
    return owned
