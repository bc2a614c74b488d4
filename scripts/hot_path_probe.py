"""What each process ``python -m scripts.hot_path`` measures loads: coverage.py started in the
thread that serves its requests or runs its tasks, recording under the context ``warm`` until the
first SIGUSR2, ``measured`` until the second, which stops coverage and saves its data.

Loaded as gunicorn's configuration (``-c python:scripts.hot_path_probe``: the project's own, plus
a ``post_worker_init`` hook) and as a module a Celery worker includes (``--include``: receivers of
``worker_ready`` in the worker's main process and ``worker_process_init`` in each pool process).
Without ``HOT_PATH_DATA`` in the environment it starts nothing.

Each process writes ``<role>-<pid>.<phase>`` into ``HOT_PATH_DATA`` as it enters a phase
(``warm``, ``measured``, ``saved``): the script signals the processes that started, and waits for
each to answer, so a phase begins in every process before the next invoice is posted. Only the
thread that started coverage is traced: the threads that run on a clock (the worker's poll, the
heartbeats) do nothing for an invoice, and would add what they happened to run in the window.
"""

from __future__ import annotations

import os
import runpy
import signal
import threading
from pathlib import Path
from typing import Any

import coverage
from celery.signals import worker_process_init, worker_ready

from scripts.hot_path import DATA, MEASURED, ROOT, SAVED, SOURCE, WARM

# gunicorn's configuration is the project's, ./gunicorn.conf.py, with post_worker_init added.
_project = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
globals().update({name: _project[name] for name in _project["__all__"]})


def _start(role: str) -> None:
    directory = os.environ.get(DATA)
    if not directory:
        return
    measured = coverage.Coverage(
        data_file=str(Path(directory) / f"{role}-{os.getpid()}.coverage"),
        source=[str(ROOT / path) for path in SOURCE],
        config_file=False,
    )
    measured.start()
    # This thread only: coverage would trace every thread started from now on.
    threading.settrace(None)
    phases = iter([MEASURED, SAVED])

    def _next_phase(signum: int, frame: Any) -> None:
        phase = next(phases, None)
        if phase == MEASURED:
            measured.switch_context(MEASURED)
        elif phase == SAVED:
            measured.stop()
            measured.save()
        if phase:
            _announce(directory, role, phase)

    signal.signal(signal.SIGUSR2, _next_phase)
    measured.switch_context(WARM)
    _announce(directory, role, WARM)


def _announce(directory: str, role: str, phase: str) -> None:
    (Path(directory) / f"{role}-{os.getpid()}.{phase}").touch()


def post_worker_init(worker: Any) -> None:
    """gunicorn: in each worker, once it loaded the application and set its signal handlers."""
    _start("web")


@worker_ready.connect(weak=False)
def _worker_ready(**_: Any) -> None:
    """The Celery worker's main process (the consumer: messages in, acknowledgements out)."""
    _start("worker")


@worker_process_init.connect(weak=False)
def _pool_process_init(**_: Any) -> None:
    """Each of the worker's pool processes (the tasks)."""
    _start("pool")
