"""A RabbitMQ node of the caller's own, for the tests and the chaos suite that restart or stall
their broker: the machine's node is shared, and nothing a run does may stop or stall it for
anyone else.

The node has its own name, AMQP port, distribution port, data directory and configuration
(no plugins), listens on loopback only, and is removed with its directory. On another host
(``stack.netns``) it is run ``via`` that host's ``ip netns exec``, with its AMQP listener on
``address`` (an address of that host's): its Erlang distribution and epmd stay on the
loopback of the host's namespace, so ``rabbitmqctl`` is run there too, and the ports are the
standard ones (that namespace's own). Its data survives
a restart on the same directory (durable quorum queues and persistent messages come back), as a
real node's does. ``pause()`` stops the whole node (SIGSTOP): connections stay open and nothing
answers, as in a stall.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from kombu import Connection

from stack.net import HOST, free_port, wait_until
from stack.process import Process

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


class RabbitNode:
    """One private node. ``config``: extra ``rabbitmq.conf`` lines (``consumer_timeout``...);
    ``address`` and ``via``: where its AMQP listener is, and the command its programs are run
    through (another host's namespace; see the module)."""

    def __init__(
        self,
        *,
        root: Path | None = None,
        name: str = "",
        config: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        address: str = HOST,
        via: Sequence[str] = (),
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rabbit-", dir=root))
        self.name = name or f"private-{uuid.uuid4().hex[:8]}"
        self.node = f"{self.name}@localhost"
        self.address = address
        self.via = list(via)
        # In a namespace of its own the standard ports are free (a port free here says
        # nothing about another namespace).
        self.port = 5672 if via else free_port()
        self.dist_port = 25672 if via else free_port()
        self.log_dir = log_dir or self.dir
        self.process: Process | None = None
        self.generation = 0
        lines = {
            "listeners.tcp.local": f"{address}:{self.port}",
            "log.console": "true",
            "log.file": "false",
            # guest may log in from loopback only, by default; off the loopback the clients
            # are the run's hosts, on the subnet of the run's own namespace.
            **({"loopback_users": "none"} if address != HOST else {}),
            **(config or {}),
        }
        (self.dir / "rabbitmq.conf").write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))
        (self.dir / "enabled_plugins").write_text("[].\n")
        # Instead of the machine's rabbitmq-env.conf (its node name and port are the shared one's).
        (self.dir / "rabbitmq-env.conf").write_text(f"ERL_EPMD_ADDRESS={HOST}\n")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.address}:{self.port}//"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "pid"),
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def answers(self, timeout: float = 2.0) -> bool:
        try:
            with Connection(self.url, connect_timeout=timeout) as conn:
                conn.ensure_connection(max_retries=1, timeout=max(1, round(timeout)))
                return True
        except Exception:  # noqa: BLE001 - any failure to connect is "not answering"
            return False

    def start(self, timeout: float = 90.0) -> RabbitNode:
        """Start the node (again, on the same data) and return once it takes connections."""
        self.generation += 1
        self.process = Process(
            [*self.via, SERVER],
            name=f"rabbitmq-{self.generation}",
            env=self.env(),
            log=self.log_dir / f"rabbitmq-{self.name}.log",
            append=True,
        )
        if not wait_until(lambda: self.answers(1.0), timeout=timeout):
            tail = self.process.log_tail()
            self.kill()
            raise TimeoutError(f"RabbitMQ node {self.node} did not start:\n{tail}")
        return self

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n <this node> args...``; its output."""
        done = subprocess.run(
            [*self.via, CTL, "-n", self.node, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        return done.stdout

    def stop(self) -> None:
        """A clean stop (SIGTERM: the node shuts down in order and keeps its data)."""
        if self.process is not None:
            self.process.stopped = True  # on purpose: not an exit to report
            self.process.stop(grace=30)

    def kill(self) -> None:
        """SIGKILL of the node, as a crash does it."""
        if self.process is not None:
            self.process.stopped = True
            self.process.kill()

    def pause(self) -> None:
        """Stop every process of the node (SIGSTOP): connections stay open, nothing answers."""
        assert self.process is not None
        self.process.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.signal_group(signal.SIGCONT)

    def remove(self) -> None:
        """Stop the node for good and delete its directory."""
        if self.process is not None and self.process.alive():
            self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
