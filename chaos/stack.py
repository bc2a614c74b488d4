"""The suite's own PostgreSQL and Redis, and the application's processes running on them.

Isolation. The faults restart Redis and PostgreSQL; doing that to the machine's shared
instances (127.0.0.1:5432 and :6379) would break every other user's work, so each arm of the
suite runs its own: a PostgreSQL cluster ``initdb``-ed into a temporary directory (owned by
the ``postgres`` OS user, since ``initdb`` refuses root) and started with ``pg_ctl`` on a free
loopback port with trust authentication and its socket in that directory, and a
``redis-server`` on a free loopback port with no persistence (``--save "" --appendonly no``),
as on this machine, so a restart drops every queued message. They are the same binaries as
the machine's instances, on loopback only.

With ``--broker rabbitmq`` the Celery broker is a RabbitMQ node of the suite's own
(``stack.rabbitmq.RabbitNode``: its own node name, ports and data directory, on loopback, or
across hosts on the data host's address of its own), and Redis stays for the cache and the
breaker; the faults then restart and stall the node (its data survives a
restart, as a real node's does), or cut hosts off from its address.

The application's processes are started by the kit (``stack.launch``), each in a process
group of its own, so a kill takes the whole process (a Celery worker's pool children too);
what is the suite's own here is supervision (``Processes``: a worker or beat that exits by
itself is recorded and started again) and the services the faults restart. ``Stack`` is a
context manager: on the way out, on an error or Ctrl-C too, it stops every process it
started, stops PostgreSQL and removes the temporary directories.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psycopg
import redis

from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST, free_port, wait_until
from stack.netns import Topology
from stack.process import ROOT, Process
from stack.rabbitmq import RabbitNode

REDIS = "redis"
RABBITMQ = "rabbitmq"
BROKERS = (REDIS, RABBITMQ)

# Across hosts (``chaos.hosts``): the host PostgreSQL, Redis (and RabbitMQ when it is the
# broker) run on, and their services' names there (each service has an address of its own, so
# a host can be cut off from one).
DATA_HOST = "data"
POSTGRES_SERVICE = "postgres"
REDIS_SERVICE = "redis"
RABBITMQ_SERVICE = "rabbitmq"


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
    except the faults, which say so (``Process.stopped``), and the teardown: every exit
    recorded here is a process that died of a fault it should have survived."""

    RESTART_DELAY = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: list[Process] = []
        self._supervised: set[Process] = set()
        self._recorded: set[Process] = set()
        self._replaced: dict[Process, Process] = {}
        self._exits: list[Exit] = []
        self._closed = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def add(self, process: Process, *, supervised: bool = False) -> Process:
        """Keep ``process`` (just started) to stop with the rest; a process started while the
        run is being torn down is stopped at once."""
        with self._lock:
            if not self._closed.is_set():
                self._processes.append(process)
                if supervised:
                    self._supervised.add(process)
                return process
        process.kill()
        raise RuntimeError(f"not running {process.name}: the run is being torn down")

    def current(self, process: Process) -> Process:
        """``process``, or the one the supervisor started in its place."""
        with self._lock:
            while process in self._replaced:
                process = self._replaced[process]
        return process

    def _supervise(self) -> None:
        while not self._closed.wait(0.5):
            with self._lock:
                dead = [
                    p
                    for p in self._processes
                    if p not in self._replaced
                    and p not in self._recorded
                    and not p.stopped
                    and p.returncode is not None
                ]
                self._recorded.update(dead)
                self._exits += [
                    Exit(p.name, p.returncode, time.time(), p in self._supervised) for p in dead
                ]
            for process in dead:
                if process in self._supervised and not self._closed.wait(self.RESTART_DELAY):
                    with contextlib.suppress(RuntimeError):  # torn down meanwhile
                        replacement = self.add(process.respawn(), supervised=True)
                        with self._lock:
                            self._replaced[process] = replacement

    def unexpected_exits(self) -> list[Exit]:
        """The processes that exited by themselves."""
        with self._lock:
            return list(self._exits)

    def stop_all(self) -> None:
        with self._lock:
            self._closed.set()
            processes = list(reversed(self._processes))
        self._supervisor.join(5)
        for process in processes:
            process.stop(grace=5)


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
    """A throw-away PostgreSQL cluster on a free loopback port, trust authentication; or on
    ``address``:5432 of another host, run ``via`` its ``ip netns exec`` (its own namespace:
    the port is free there)."""

    def __init__(self, root: Path, *, address: str = HOST, via: Sequence[str] = ()) -> None:
        self.root = root
        self.data = root / "data"
        self.address = address
        self.via = list(via)
        self.port = 5432 if via else free_port()
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
        if via:
            # initdb trusts loopback only; on another host the clients are the run's hosts, on
            # the subnet of the run's own namespace ("samenet": the server's own subnets).
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all samenet trust\n")

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(  # noqa: S603 - our own argv, no shell
            [*self.via, *_as_postgres(), str(self.bindir / tool), *args],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # the postmaster inherits these: never a pipe
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=120,
        )

    def url(self, database: str) -> str:
        return f"postgres://postgres@{self.address}:{self.port}/{database}"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses={self.address} "
            "-c max_connections=200"
        )
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
    """A redis-server on a free loopback port with no persistence, restartable on that port;
    or on ``address``:6379 of another host, run ``via`` its ``ip netns exec``."""

    def __init__(
        self,
        root: Path,
        processes: Processes,
        log_dir: Path,
        *,
        address: str = HOST,
        via: Sequence[str] = (),
    ) -> None:
        self.dir = root / "redis"
        self.dir.mkdir()
        self.address = address
        self.via = list(via)
        self.port = 6379 if via else free_port()
        self.processes = processes
        self.log_dir = log_dir
        self.process: Process | None = None
        self.generation = 0

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}"

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(
            host=self.address,
            port=self.port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )

    def start(self) -> None:
        self.generation += 1
        name = f"redis-{self.generation}"
        argv = [
            *self.via,
            "redis-server",
            "--bind",
            self.address,
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
            # Off the loopback, Redis without a password answers only "DENIED": here it is on
            # an address of the run's own namespace, reachable from the run's hosts alone.
            *(("--protected-mode", "no") if self.via else ()),
        ]
        self.process = self.processes.add(
            Process(argv, name=name, env=os.environ, log=self.log_dir / f"{name}.log", append=True)
        )
        if not wait_until(lambda: self.client(0.5).ping(), timeout=20, ignore=(redis.RedisError,)):
            raise TimeoutError("timed out after 20 s waiting for redis")

    def shutdown_nosave(self) -> None:
        """``SHUTDOWN NOSAVE``: everything in memory (every queued message) is gone."""
        if self.process is not None:
            self.process.stopped = True  # on purpose: not an exit to report
        with contextlib.suppress(redis.RedisError):
            self.client().shutdown(nosave=True)
        if self.process is not None:
            try:
                self.process.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Stack:
    """PostgreSQL, Redis and the application's processes for one arm of the suite; with
    ``net``, across its hosts: PostgreSQL, Redis and the RabbitMQ node on ``DATA_HOST`` (each
    on its service's address), every application process on the host its caller names."""

    def __init__(
        self,
        *,
        log_dir: Path,
        app_env: Mapping[str, str],
        broker: str = REDIS,
        net: Topology | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.app_env = dict(app_env)
        self.broker = broker
        self.net = net
        self.tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.postgres: Postgres | None = None
        self.redis: RedisServer | None = None
        self.rabbit: RabbitNode | None = None
        self.processes = Processes()

    def __enter__(self) -> Stack:
        try:
            address, via = self._placed(POSTGRES_SERVICE)
            self.postgres = Postgres(self.tmp / "pg", address=address, via=via)
            self.postgres.start()
            address, via = self._placed(REDIS_SERVICE)
            self.redis = RedisServer(
                self.tmp, self.processes, self.log_dir, address=address, via=via
            )
            self.redis.start()
            if self.broker == RABBITMQ:
                address, via = self._placed(RABBITMQ_SERVICE)
                self.rabbit = RabbitNode(
                    root=self.tmp,
                    name=f"chaos-{self.tmp.name[-8:]}",
                    log_dir=self.log_dir,
                    address=address,
                    via=via,
                )
                self.rabbit.start()
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
        if self.rabbit is not None:
            self.rabbit.remove()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _placed(self, service: str) -> tuple[str, list[str]]:
        """Where ``service`` listens, and the command that runs it there."""
        if self.net is None:
            return HOST, []
        return self.net.service_address(service), self.via(self.net.service_host(service))

    def via(self, host: str | None) -> list[str]:
        """The command that runs a program on ``host`` (nothing: here)."""
        if host is None or self.net is None:
            return []
        return self.net.argv(host, [])

    # --- the broker's faults -----------------------------------------------------------------

    @property
    def broker_service(self) -> str:
        """The broker's service name (across hosts: what a host is cut off from)."""
        return RABBITMQ_SERVICE if self.broker == RABBITMQ else REDIS_SERVICE

    @property
    def broker_url(self) -> str:
        if self.rabbit is not None:
            return self.rabbit.url
        assert self.redis is not None
        return f"{self.redis.url}/0"

    def broker_pause(self, seconds: float) -> None:
        """Nothing the broker answers for ``seconds`` (connections stay open); returns at once.
        Redis: ``CLIENT PAUSE <ms> ALL``; RabbitMQ: the node stopped (SIGSTOP), then resumed."""
        if self.rabbit is not None:
            self.rabbit.pause()
            threading.Timer(seconds, self.rabbit.resume).start()
            return
        assert self.redis is not None
        self.redis.client().execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")

    def broker_answers(self) -> bool:
        if self.rabbit is not None:
            return self.rabbit.answers(1.0)
        assert self.redis is not None
        try:
            return bool(self.redis.client().ping())
        except redis.RedisError:
            return False

    # --- the application ---------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The application's environment: the arm's settings plus this stack's addresses."""
        assert self.postgres is not None
        assert self.redis is not None
        return {
            **self.app_env,
            "DATABASE_URL": self.postgres.url("chaos"),
            "CELERY_BROKER_URL": self.broker_url,
            "REDIS_URL": f"{self.redis.url}/1",
            **extra,
        }

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

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

    def relay_probe(self, name: str, *, freeze_after: int) -> Process:
        """``chaos.relay_probe`` (the machinery's relay, frozen on its N-th publish), its
        stdin and stdout piped to the caller."""
        return self.processes.add(
            Process(
                [sys.executable, "-m", "chaos.relay_probe", "--freeze-after", str(freeze_after)],
                name=name,
                env=self.env(),
                log=self.log(name),
                append=True,
                pipes=True,
            )
        )

    def start_worker(
        self,
        name: str,
        *,
        concurrency: int,
        settings_module: str,
        app: str = "core",
        host: str | None = None,
    ) -> Process:
        """A supervised Celery worker of ``app`` (on ``host``), in a process group of its own;
        returns once it is ready."""
        worker = launch.celery_worker(
            # The " ready." line is logged at INFO, and the application's logging settings
            # (not Celery's -l) decide what a worker logs.
            self.env(DJANGO_SETTINGS_MODULE=settings_module, LOG_LEVEL="INFO"),
            name=name,
            app=app,
            concurrency=concurrency,
            log=self.log(name),
            append=True,
            via=self.via(host),
        )
        return self.processes.add(worker, supervised=True).wait_ready(timeout=60)

    def start_beat(self, name: str = "beat", *, host: str | None = None) -> Process:
        """A supervised beat (on ``host``); across hosts it logs its dispatches (INFO)."""
        env, level = (
            (self.env(), "WARNING") if host is None else (self.env(LOG_LEVEL="INFO"), "INFO")
        )
        beat = launch.celery_beat(
            env, name=name, loglevel=level, log=self.log(name), append=True, via=self.via(host)
        )
        return self.processes.add(beat, supervised=True)

    @contextlib.contextmanager
    def web(
        self, *, workers: int, host: str | None = None, port: int = 0
    ) -> Iterator[tuple[str, int]]:
        """gunicorn core.wsgi (on ``host``, on ``port`` if given), ready once Django answers;
        its address and port."""
        name = "gunicorn" if host is None else f"gunicorn-{host}"
        address = HOST if host is None or self.net is None else self.net.address(host)
        placed = (
            contextlib.nullcontext() if host is None or self.net is None else self.net.inside(host)
        )
        with placed:
            server = launch.gunicorn(
                self.env(),
                config=GunicornConfig(workers=workers, timeout=30),
                log=self.log(name),
                name=name,
                host=address,
                port=port,
                via=self.via(host),
            )
        with server:
            yield address, server.port


class WorkerPool:
    """``count`` Celery workers of ``app``, each in a process group of its own, restartable by
    index; worker ``i`` on ``hosts[i]`` when given."""

    def __init__(
        self,
        stack: Stack,
        *,
        count: int,
        concurrency: int,
        settings_module: str,
        app: str = "core",
        hosts: Sequence[str] = (),
    ) -> None:
        self.stack = stack
        self.concurrency = concurrency
        self.settings_module = settings_module
        self.app = app
        self.hosts = list(hosts)
        self._workers: list[Process] = []
        self.starts = 0
        for index in range(count):
            self._workers.append(self._start(index))

    def __len__(self) -> int:
        return len(self._workers)

    def worker(self, index: int) -> Process:
        """The worker at ``index`` now (the supervisor may have started it again)."""
        return self.stack.processes.current(self._workers[index])

    def _start(self, index: int) -> Process:
        self.starts += 1
        return self.stack.start_worker(
            f"worker{index + 1}-{self.starts}",
            concurrency=self.concurrency,
            settings_module=self.settings_module,
            app=self.app,
            host=self.hosts[index] if self.hosts else None,
        )

    def restart(self, index: int) -> Process:
        self._workers[index] = self._start(index)
        return self._workers[index]

    def pid_index(self) -> dict[int, int]:
        """Every live worker process (parents and pool children) -> its worker's index."""
        return {pid: i for i in range(len(self)) for pid in self.worker(i).pids()}


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
