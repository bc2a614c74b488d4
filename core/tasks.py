"""The task base every job shares, and the outbox relay task.

``ReliableTask`` encodes the retry doctrine once:

* ``TransientError`` (and a lost database connection or a soft time limit) is retried with
  exponential backoff and full jitter, by Celery's own ``autoretry_for`` machinery, at most
  ``max_retries`` times;
* anything else, or a transient failure on its last attempt, is dead-lettered at once with
  the reason, the exception and the traceback (``core.deadletters``);
* ``acks_late`` + ``reject_on_worker_lost``: a worker that dies mid-task leaves the message to
  be redelivered, and the dead letter is written before the message is acknowledged, so a
  worker dying while it dead-letters runs the job again rather than losing it.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError
from django.utils import timezone

from core import queues

logger = logging.getLogger(__name__)


class TransientError(Exception):
    """A failure worth retrying: the dependency may answer next time."""


class PermanentError(Exception):
    """A failure no retry can fix: dead-letter at once."""


class ReliableTask(Task):
    autoretry_for = (TransientError, SoftTimeLimitExceeded, OperationalError, InterfaceError)
    retry_jitter = True  # full jitter: randrange(countdown + 1)
    acks_late = True
    reject_on_worker_lost = True

    def retry(self, *args: Any, **options: Any) -> Any:
        # Carry the time of the first failure across retries, for the dead letter.
        headers = dict(options.pop("headers", None) or {})
        headers.setdefault("first_failed_at", self._first_failed_at().isoformat())
        return super().retry(*args, headers=headers, **options)

    def _first_failed_at(self) -> datetime:
        value = getattr(self.request, "first_failed_at", None)
        try:
            return datetime.fromisoformat(value) if value else timezone.now()
        except (TypeError, ValueError):
            return timezone.now()

    def on_failure(
        self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        from core.deadletters import dead_letter_record
        from core.models import DeadLetter

        transient = isinstance(exc, self.autoretry_for)
        reason = DeadLetter.Reason.EXHAUSTED if transient else DeadLetter.Reason.PERMANENT
        reason = getattr(exc, "dead_letter_reason", reason)
        delivery = self.request.delivery_info or {}
        dead_letter_record(
            task=self.name,
            task_id=task_id,
            args=list(args or ()),
            kwargs=dict(kwargs or {}),
            queue=delivery.get("routing_key") or queues.queue_for(self.name),
            reason=reason,
            exc=exc,
            traceback=str(einfo) if einfo else "",
            attempts=self.request.retries + 1,
            first_failed_at=self._first_failed_at(),
        )
