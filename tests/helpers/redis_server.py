"""A ``redis-server`` of a test's own, for the tests that restart or pause their broker: the
machine's Redis is shared, and nothing a test does may stop or stall it for anyone else."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import redis

from stack.net import HOST, free_port, wait_until
from stack.process import Process


class PrivateRedis:
    """A redis-server on a free loopback port with nothing on disk, restartable on its port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="test-redis-"))
        self.url = f"redis://{HOST}:{self.port}/0"
        self.process: Process | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, socket_timeout=2)

    def start(self) -> None:
        argv = ["redis-server", "--bind", HOST, "--port", str(self.port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.dir)]
        self.process = Process(argv, name="redis", env=os.environ, log=self.dir / "redis.log")
        pinged = wait_until(lambda: self.client().ping(), 20, ignore=(redis.RedisError,))
        assert pinged, self.process.log_tail()

    def shutdown_nosave(self) -> None:
        assert self.process is not None
        self.process.stopped = True
        with contextlib.suppress(redis.RedisError):  # the connection closes under it
            self.client().shutdown(nosave=True)
        self.process.popen.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.alive():
            self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
