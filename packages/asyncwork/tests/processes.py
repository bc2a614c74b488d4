"""Real processes for the tests that need them: a Celery worker of the test app (``celery -A
shop.celery worker``) on this run's database and broker, and a ``redis-server`` of a test's own,
for the tests that stop their broker (the machine's Redis is shared: nothing here stops it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from django.db import connection

HERE = Path(__file__).parent


def wait_until(condition: Callable[[], object], seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Worker:
    """``celery -A shop.celery worker`` in a process group of its own, its output in a file."""

    def __init__(self, *, broker: str | None = None, log: Path) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "settings",
            "PYTHONPATH": str(HERE),
            "ASYNCWORK_TESTS_DATABASE": str(connection.settings_dict["NAME"]),
        }
        if broker is not None:
            env["ASYNCWORK_TESTS_BROKER"] = broker
        self.log = log
        argv = [sys.executable, "-m", "celery", "-A", "shop.celery", "worker"]
        argv += ["--pool=prefork", "--concurrency=1", "--loglevel=INFO", "--without-mingle"]
        argv += ["--without-gossip", f"--hostname=test-{os.getpid()}-{time.monotonic_ns()}@%h"]
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=HERE,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ready(self) -> bool:
        return " ready." in self.log.read_text(errors="replace")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the whole group: the worker and its pool process die as a crash does."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def worker(tmp_path: Path, *, broker: str | None = None, name: str = "worker") -> Iterator[Worker]:
    started = Worker(broker=broker, log=tmp_path / f"{name}.log")
    try:
        assert wait_until(started.ready, 60), started.text()[-3000:]
        yield started
    finally:
        started.stop()


class PrivateRedis:
    """A redis-server on a free loopback port with nothing on disk, restartable on its port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="asyncwork-redis-"))
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.dir)]
        self.popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        assert wait_until(answers, 20)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
