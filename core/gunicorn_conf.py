"""gunicorn hooks for prometheus-client's multiprocess mode, opt-in:
``gunicorn -c python:core.gunicorn_conf core.wsgi`` (with ``PROMETHEUS_MULTIPROC_DIR`` set).

Without ``PROMETHEUS_MULTIPROC_DIR`` both hooks do nothing.
"""

from __future__ import annotations

import os
from typing import Any


def on_starting(server: Any) -> None:
    """In the master, before any worker forks: counts of an earlier run must not be added to
    this one's."""
    from core.metrics import multiprocess_dir_reset

    multiprocess_dir_reset()


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's counters stay in the sum; only live gauges of its pid are dropped."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
