"""Real Celery workers for tests: in-process (threads) and as separate OS processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from celery.contrib.testing.worker import start_worker
from django.db import connection

from core.celery import app

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def worker_thread(concurrency: int = 2) -> Iterator[None]:
    """A real worker consuming the real Redis broker, in this process (threads pool)."""
    app.loader.import_default_modules()
    with start_worker(
        app,
        pool="threads",
        concurrency=concurrency,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=30,
    ):
        yield


def worker_env(smtp_port: int, **extra: str) -> dict[str, str]:
    """The environment of a worker process that shares this test's database and broker."""
    db = connection.settings_dict
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(smtp_port),
        **extra,
    }


class WorkerProcess:
    """``celery -A core worker`` as a child process, started in its own process group so the
    whole worker (parent and pool children) can be SIGKILLed at once."""

    def __init__(
        self,
        env: dict[str, str],
        name: str,
        concurrency: int = 1,
        include: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.log = Path(tempfile.mkdtemp(prefix="worker-")) / f"{name}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
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
                *(["--include", ",".join(include)] if include else []),
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log.read_text()}")
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready:\n{self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL the whole worker: nothing is left to requeue its message."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log_file.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self.kill()

    def output(self) -> str:
        return self.log.read_text()
