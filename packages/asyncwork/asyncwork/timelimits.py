"""A soft time limit reaches only the task it was set for.

In a prefork worker the soft limit is a timer in the main process, which sends ``SIGUSR1`` to the
pool process while the job is in its cache of unfinished jobs. If the main loop was held up
(reconnecting to a restarted broker), the timer fires for a finished job, and the signal can
interrupt the pool process writing that job's result: the main process fails to decode it
(``Unrecoverable error: UnicodeDecodeError``) and the worker stops taking tasks
(``tests/asyncwork/test_timelimits.py``).

So each pool process replaces billiard's handler with one that raises only while a task runs in
it (between ``task_prerun`` and ``task_postrun``) and otherwise ignores the signal with a
warning.
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


def _task_started(**_: Any) -> None:
    # Only a prefork pool process (billiard's handler installed, main thread) gets the signal.
    if (
        SIG_SOFT_TIMEOUT is not None
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler
    ):
        signal.signal(SIG_SOFT_TIMEOUT, _soft_timeout)
    _running.set()


def _task_ended(**_: Any) -> None:
    _running.clear()


def celery_signals_connect() -> None:
    task_prerun.connect(_task_started, weak=False, dispatch_uid="asyncwork.timelimits.started")
    task_postrun.connect(_task_ended, weak=False, dispatch_uid="asyncwork.timelimits.ended")
