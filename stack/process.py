"""One child process, in a process group of its own, with its output in a log file.

What a ``Process`` guarantees:

* stopping it leaves nothing behind: ``stop()`` asks the process it started to finish (its
  stop signal, SIGTERM unless told otherwise, so gunicorn's master and Celery's main process
  wind their own children down in order), then SIGKILLs the whole process group, children
  and orphans included, and reaps it; ``kill()`` is the SIGKILL of the group alone, as a
  crash does it;
* an error about it says why: ``wait_ready()`` raises ``ProcessError`` with the tail of the
  log when the process exits before it is ready or is not ready in time, and stops it first,
  so ``with launch.x(...) as p:`` never leaks a half-started process;
* Ctrl-C in a terminal reaches the caller only (a new session), which stops it in order.

Used as a context manager it is ready inside the block and stopped after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent

Ready = Callable[["Process"], object]


class ProcessError(RuntimeError):
    """A process exited or did not become ready; the message ends with its log's tail."""


class Process:
    """``argv`` started at once in a process group of its own, from ``cwd`` (the repository),
    with exactly ``env``; stdout and stderr go to ``log`` (a new temporary file if not given;
    ``append`` keeps what an earlier process wrote there). With ``pipes``, stdin and stdout are
    text pipes to the caller and only stderr is logged. ``ready(process)`` says when it is
    ready (by default: once it runs). ``port`` is where it listens, for a server; ``owns`` is
    a directory it owns, removed once it is stopped."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str],
        log: Path | None = None,
        append: bool = False,
        ready: Ready | None = None,
        stop_signal: signal.Signals = signal.SIGTERM,
        pipes: bool = False,
        pass_fds: Sequence[int] = (),
        port: int = 0,
        owns: Path | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.argv = list(argv)
        self.name = name
        self.env = dict(env)
        self.log = log or Path(tempfile.mkdtemp(prefix=f"{name}-")) / f"{name}.log"
        self.ready = ready
        self.stop_signal = stop_signal
        self.port = port
        self.owns = owns
        self.cwd = cwd
        self.pipes = pipes
        self.stopped = False  # stop() or kill() was called: an exit the caller asked for
        self._is_ready = False
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab" if append else "wb") as out:
            self.popen: subprocess.Popen[Any] = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env=self.env,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else out,
                stderr=out if pipes else subprocess.STDOUT,
                text=pipes,
                pass_fds=tuple(pass_fds),
                start_new_session=True,
            )

    def __repr__(self) -> str:
        return f"<Process {self.name} pid {self.pid}>"

    # --- state --------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The process started, which leads its process group."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def stdin(self) -> IO[str]:
        assert self.popen.stdin is not None, "started without pipes"
        return self.popen.stdin

    @property
    def stdout(self) -> IO[str]:
        assert self.popen.stdout is not None, "started without pipes"
        return self.popen.stdout

    def pids(self) -> list[int]:
        """Every live process of its group: the leader and its children (a Celery worker's
        pool, gunicorn's workers), and any orphan of theirs still in the group (not the dead
        waiting to be reaped)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                # Fields after the parenthesised command: state, ppid, pgrp, ...
                state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
                if int(group) == self.pid and state not in {"Z", "X"}:
                    found.append(int(stat.parent.name))
        return found

    # --- its log ------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(nothing logged)"

    # --- readiness ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``ProcessError`` if it has exited."""
        if self.popen.poll() is not None:
            raise ProcessError(
                f"{self.name} exited with {self.popen.returncode}; its log ({self.log}) "
                f"ends:\n{self.log_tail()}"
            )

    def wait_ready(self, timeout: float = 60.0) -> Process:
        """Return once ``ready`` holds; stop it and raise ``ProcessError`` if it exits first or
        is not ready within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while not self._is_ready:
                self.check()
                if self.ready is None or self.ready(self):
                    self._is_ready = True
                elif time.monotonic() > deadline:
                    raise ProcessError(
                        f"{self.name} not ready within {timeout:g} s; its log ({self.log}) "
                        f"ends:\n{self.log_tail()}"
                    )
                else:
                    time.sleep(0.1)
        except BaseException:
            self.stop(grace=5)
            raise
        return self

    # --- ending it ----------------------------------------------------------------------------

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        """Send the stop signal to the process started (not yet to its children)."""
        self.stopped = True
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(self.stop_signal)

    def kill(self) -> None:
        """SIGKILL the whole process group at once and reap the leader."""
        self.stopped = True
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._close()

    def stop(self, grace: float = 10.0) -> None:
        """The stop signal, up to ``grace`` seconds to finish, then SIGKILL of the group."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace)
        self.kill()

    def _close(self) -> None:
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.owns is not None and self.popen.poll() is not None:
            shutil.rmtree(self.owns, ignore_errors=True)

    def respawn(self) -> Process:
        """A new process started as this one was, logging after it in the same file."""
        return Process(
            self.argv,
            name=self.name,
            env=self.env,
            log=self.log,
            append=True,
            ready=self.ready,
            stop_signal=self.stop_signal,
            pipes=self.pipes,
            port=self.port,
            cwd=self.cwd,
        )

    def __enter__(self) -> Process:
        return self.wait_ready()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_all(processes: Iterable[Process], grace: float = 10.0) -> None:
    """Stop several at once: each gets its stop signal, then all share the ``grace``
    seconds, then each whole group is SIGKILLed."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(max(0.1, deadline - time.monotonic()))
    for process in processes:
        process.kill()
