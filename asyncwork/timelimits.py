"""A soft time limit reaches only the task it was set for.

In a prefork worker the soft time limit is a timer in the worker's main process: when it
fires while the job is still in the pool's cache of unfinished jobs, the main process sends
``SIGUSR1`` to the pool process that took the job, whose handler (billiard's) raises
``SoftTimeLimitExceeded`` wherever that process happens to be. The cache is emptied only when
the main process reads the job's result; if its event loop was held up meanwhile (reconnecting
to a broker that restarted, for seconds), the timer fires for a job that has already finished,
and the signal lands in a pool process that is writing that job's result to the main process,
or waiting for its next job. Interrupted mid-write, the result arrives truncated; the main
process fails to decode it (``Unrecoverable error: UnicodeDecodeError``) and the worker stops
taking tasks (a Redis restart under load does it; ``tests/asyncwork/test_timelimits.py`` sends
the late signal to a real worker's idle pool process).

So each pool process replaces billiard's handler, once, by one that raises only while a task
is running in it (between Celery's ``task_prerun`` and ``task_postrun``, which a task sends
however it ends) and ignores the signal otherwise, with a warning. A limit that fires while
its task runs raises in the task, as billiard's does.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery.signals import task_postrun, task_prerun

logger = logging.getLogger(__name__)

_running = threading.Event()
_IGNORED = "soft time limit signal ignored: no task is running in this process (its job ended)"


def _soft_timeout(signum: int, frame: FrameType | None) -> None:
    if _running.is_set():
        raise SoftTimeLimitExceeded()
    logger.warning(_IGNORED)


def _guard_install() -> None:
    """In a prefork pool process (billiard's handler installed, on the main thread), put the
    guarded handler in its place; elsewhere (solo, threads) there is no such signal."""
    if SIG_SOFT_TIMEOUT is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler:
        signal.signal(SIG_SOFT_TIMEOUT, _soft_timeout)


def _task_started(**_: Any) -> None:
    _guard_install()
    _running.set()


def _task_ended(**_: Any) -> None:
    _running.clear()


def celery_signals_connect() -> None:
    task_prerun.connect(_task_started, weak=False, dispatch_uid="asyncwork.timelimits.started")
    task_postrun.connect(_task_ended, weak=False, dispatch_uid="asyncwork.timelimits.ended")
