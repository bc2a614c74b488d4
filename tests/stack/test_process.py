"""stack.process: a process that fails says why (its log's tail), and stopping or killing one
leaves nothing of its group behind, children that ignore SIGTERM and orphans included."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stack.net import wait_until
from stack.process import Process, ProcessError, stop_all
from tests.helpers.source import TOOLS, calls_named, python_files

# A leader that forks ``children`` processes which ignore SIGTERM, each (leader too) leaving a
# file named after its pid in the directory given, and (with ``stubborn``) ignores SIGTERM
# itself; then everyone sleeps.
FAMILY = """
import os, pathlib, signal, sys, time
here, children, stubborn = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
for _ in range(children):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (here / str(os.getpid())).touch()
        time.sleep(120)
        os._exit(0)
if stubborn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(here / str(os.getpid())).touch()
time.sleep(120)
"""


@pytest.fixture
def spawned() -> Iterator[list[Process]]:
    """The processes a test starts, killed after it whatever happened."""
    processes: list[Process] = []
    yield processes
    for process in processes:
        process.kill()


def family(
    where: Path, spawned: list[Process], *, children: int = 2, stubborn: bool = False
) -> Process:
    pids = where / "pids"
    pids.mkdir(parents=True)
    process = Process(
        [sys.executable, "-c", FAMILY, str(pids), str(children), "1" if stubborn else "0"],
        name="family",
        env=dict(os.environ),
        log=where / "family.log",
        ready=lambda p: len(list(pids.iterdir())) == children + 1,
    )
    spawned.append(process)
    return process.wait_ready(timeout=30)


def family_pids(process: Process) -> list[int]:
    return sorted(int(path.name) for path in (process.log.parent / "pids").iterdir())


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for whoever inherited it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state in {"Z", "X"}


def test_a_process_that_exits_before_it_is_ready_says_why_with_its_log(tmp_path: Path) -> None:
    process = Process(
        [sys.executable, "-c", "print('Configuration error: FOO must be set'); exit(3)"],
        name="early",
        env=dict(os.environ),
        log=tmp_path / "early.log",
        ready=lambda p: False,
    )
    with pytest.raises(ProcessError) as failure:
        process.wait_ready(timeout=30)
    message = str(failure.value)
    assert "early exited with 3" in message
    assert "Configuration error: FOO must be set" in message
    assert str(tmp_path / "early.log") in message


def test_a_process_never_ready_is_stopped_and_the_error_names_the_wait(tmp_path: Path) -> None:
    process = Process(
        [sys.executable, "-c", "print('still starting', flush=True); import time; time.sleep(60)"],
        name="slow",
        env=dict(os.environ),
        log=tmp_path / "slow.log",
        ready=lambda p: False,
    )
    with pytest.raises(ProcessError, match=r"slow not ready within 0\.5 s") as failure:
        process.wait_ready(timeout=0.5)
    assert "still starting" in str(failure.value)
    assert not process.alive()
    assert process.stopped


def test_the_context_manager_is_ready_inside_and_stopped_after(
    tmp_path: Path, spawned: list[Process]
) -> None:
    with family(tmp_path, spawned, children=1) as process:
        assert process.alive()
        assert sorted(process.pids()) == sorted(family_pids(process))
    assert not process.alive()
    assert wait_until(lambda: all(gone(pid) for pid in family_pids(process)), timeout=10)


def test_stop_takes_the_whole_group_children_that_ignore_sigterm_included(
    tmp_path: Path, spawned: list[Process]
) -> None:
    process = family(tmp_path, spawned, children=2)
    pids = family_pids(process)
    assert len(pids) == 3
    assert sorted(process.pids()) == sorted(pids)

    started = time.monotonic()
    process.stop(grace=1)

    assert process.returncode == -signal.SIGTERM  # the leader took the stop signal
    assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=10)
    assert time.monotonic() - started < 5
    assert process.pids() == []


def test_stop_escalates_to_sigkill_after_the_grace(tmp_path: Path, spawned: list[Process]) -> None:
    process = family(tmp_path, spawned, children=1, stubborn=True)
    pids = family_pids(process)
    started = time.monotonic()
    process.stop(grace=1)
    assert 1 <= time.monotonic() - started < 5
    assert process.returncode == -signal.SIGKILL
    assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=10)


def test_kill_is_a_sigkill_of_the_group_at_once(tmp_path: Path, spawned: list[Process]) -> None:
    process = family(tmp_path, spawned, children=2, stubborn=True)
    pids = family_pids(process)
    started = time.monotonic()
    process.kill()
    assert time.monotonic() - started < 2
    assert process.returncode == -signal.SIGKILL
    assert wait_until(lambda: all(gone(pid) for pid in pids), timeout=10)


def test_stop_reaches_orphans_of_a_leader_that_already_died(
    tmp_path: Path, spawned: list[Process]
) -> None:
    orphan_maker = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    print('child', os.getpid(), flush=True)\n"
        "    time.sleep(120)\n"
        "time.sleep(0.5)\n"
    )
    process = Process(
        [sys.executable, "-c", orphan_maker],
        name="orphans",
        env=dict(os.environ),
        log=tmp_path / "orphans.log",
    )
    spawned.append(process)
    assert wait_until(lambda: not process.alive(), timeout=10)
    [orphan] = [int(line.split()[1]) for line in process.log_text().splitlines()]
    assert not gone(orphan)
    process.stop(grace=1)
    assert wait_until(lambda: gone(orphan), timeout=10)


def test_stop_all_shares_one_grace_period(tmp_path: Path, spawned: list[Process]) -> None:
    stubborn = [family(tmp_path / str(n), spawned, children=0, stubborn=True) for n in range(3)]
    started = time.monotonic()
    stop_all(stubborn, grace=1)
    assert time.monotonic() - started < 3  # not three graces one after the other
    assert all(p.returncode == -signal.SIGKILL for p in stubborn)


def test_respawn_starts_it_again_logging_after_the_first(tmp_path: Path) -> None:
    say = [sys.executable, "-c", "import os; print('run', os.getpid(), flush=True)"]
    first = Process(say, name="again", env=dict(os.environ), log=tmp_path / "again.log")
    first.popen.wait(10)
    second = first.respawn()
    second.popen.wait(10)
    assert second.pid != first.pid
    assert second.log == first.log
    assert first.log.read_text().split() == ["run", str(first.pid), "run", str(second.pid)]


def test_pipes_are_the_callers_and_only_stderr_is_logged(
    tmp_path: Path, spawned: list[Process]
) -> None:
    echo = "import sys; print('to the log', file=sys.stderr, flush=True); print(input().upper())"
    process = Process(
        [sys.executable, "-c", echo],
        name="piped",
        env=dict(os.environ),
        log=tmp_path / "piped.log",
        pipes=True,
    )
    spawned.append(process)
    process.stdin.write("hello\n")
    process.stdin.flush()
    assert process.stdout.readline() == "HELLO\n"
    process.stop(grace=5)
    assert process.log_text() == "to the log\n"


def test_only_the_kit_makes_and_ends_process_groups() -> None:
    """One way to stop a process and everything it started: no other file starts a process
    in a session of its own or signals a process group."""
    found = {
        path: lines
        for path in python_files(*TOOLS)
        if (lines := list(calls_named(path, "killpg", "setsid", "setpgid", "start_new_session")))
    }
    assert found.keys() == {"stack/process.py"}, found
