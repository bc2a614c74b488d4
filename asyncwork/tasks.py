"""The task base every job shares (scheduled jobs have their own, in ``asyncwork.jobs``).

``ReliableTask`` encodes the retry doctrine once:

* ``TransientError`` (and a lost database connection or a soft time limit) is retried with
  exponential backoff and full jitter, by Celery's own ``autoretry_for`` machinery, at most
  ``max_retries`` times;
* anything else, or a transient failure on its last attempt, is dead-lettered at once with
  the reason, the exception and the traceback (``asyncwork.deadletters``);
* ``acks_late`` + ``reject_on_worker_lost``: a worker that dies mid-task leaves the message to
  be redelivered, and the dead letter is written before the message is acknowledged, so a
  worker dying while it dead-letters runs the job again rather than losing it.
* ``Deferred`` (a dependency known to be down, e.g. an open circuit breaker) is not a
  failure: ``defer()`` re-publishes the job after the dependency's cool-down plus jitter with
  its retry count unchanged, so no attempt is spent, until a deadline counted from the first
  deferral; then it is dead-lettered with the exception's reason.
* a retry or a deferral waits in PostgreSQL, not in a worker: it is an outbox row due after
  its countdown (``outbox_schedule``), which a worker publishes once due
  (``asyncwork.scheduled``), and this message is acknowledged. Celery's own retry publishes
  the message with an ETA, which a worker then holds unacknowledged for the whole countdown:
  on Redis, if that worker dies, the message is back only after the visibility timeout. If
  the database cannot take the row (or the task retries inside a transaction, which would
  roll it back), Celery's own path is taken.
* a dead letter is logged once: one ERROR line (``asyncwork.deadletters``) naming the dead letter,
  the task, its id, its args and the reason. A failure the task declares (permanent,
  transient, deferred) logs no traceback: it is kept on the ``DeadLetter`` row. Any other
  exception is a bug, and its line carries the traceback, which is what whoever fixes it
  needs first. Celery's own failure line says the same thing a second time, so it is kept at
  INFO without a traceback (``throws``).
"""

from __future__ import annotations

import logging
import math
import random
from datetime import datetime, timedelta
from typing import Any

from celery import Task
from celery.exceptions import Reject, Retry, SoftTimeLimitExceeded
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection
from django.utils import timezone

from asyncwork import queues
from asyncwork.deadletters import dead_letter_record
from asyncwork.errors import Deferred, PermanentError, RedeliveredTooOften, TransientError
from asyncwork.models import DeadLetter
from asyncwork.outbox import outbox_schedule

logger = logging.getLogger(__name__)


class ReliableTask(Task):
    autoretry_for = (TransientError, SoftTimeLimitExceeded, OperationalError, InterfaceError)
    retry_jitter = True  # full jitter: randrange(countdown + 1)
    acks_late = True
    reject_on_worker_lost = True
    # Every failure that reaches Celery's failure handler is dead-lettered by on_failure, and
    # the dead letter's ERROR line is the record. Celery logs a failure whose exception is in
    # ``throws`` as "raised expected" at INFO without a traceback, instead of "raised
    # unexpected" at ERROR with one: without this, each dead letter is logged twice.
    throws = (Exception,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # RabbitMQ counts a message's earlier deliveries (Redis does not: no header there).
        delivered = _delivery_count(self.request)
        if delivered is not None and delivered + 1 >= settings.BROKER_DELIVERY_LIMIT:
            raise RedeliveredTooOften(
                f"delivered {delivered + 1} times; the {delivered} before ended with no "
                "outcome (the worker running it died or lost the broker)"
            )
        return super().__call__(*args, **kwargs)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``retry``, whose wait is an outbox row (``_schedule``) rather than a
        message held with an ETA. A retry past ``max_retries``, or one that changes the job
        (new args, an ETA, other options), is Celery's own."""
        # Carry the time of the first failure across retries, for the dead letter, and keep
        # the job's other headers (first_deferred_at: a retry must not restart the deadline).
        request = self.request
        headers = {**_job_headers(request), **(options.pop("headers", None) or {})}
        headers.setdefault("first_failed_at", self._first_failed_at().isoformat())
        limit = self.max_retries if max_retries is None else max_retries
        own = (
            args is None
            and kwargs is None
            and eta is None
            and not options
            and (limit is None or request.retries < limit)
        )
        if own:
            countdown = self.default_retry_delay if countdown is None else countdown
            if self._schedule(countdown=countdown, retries=request.retries + 1, headers=headers):
                retry = Retry(exc=exc, when=timezone.now() + timedelta(seconds=countdown))
                if throw:
                    raise retry
                return retry
        return super().retry(
            args,
            kwargs,
            exc,
            throw,
            eta,
            countdown,
            max_retries,
            headers=headers,
            **options,
        )

    def _schedule(self, *, countdown: float, retries: int, headers: dict[str, Any]) -> bool:
        """Write this job's next run as an outbox row due in ``countdown`` seconds, carrying
        ``retries`` and ``headers``; False where it cannot wait there (called directly, eager,
        inside a transaction that raising would roll back, or the database refused)."""
        request = self.request
        if request.called_directly or request.is_eager or connection.in_atomic_block:
            return False
        queue = queues.queue_delivered(request.delivery_info, self.name)
        try:
            outbox_schedule(
                task=self.name,
                args=list(request.args or ()),
                kwargs=dict(request.kwargs or {}),
                # Onto the queue read ahead of its own, as recovered work: a job that waited
                # out its backoff is older than the backlog queued behind it since (Celery's
                # own retry jumps the queue too: the worker holding it runs it when due).
                queue=queues.queue_ahead(queue),
                due_in=countdown,
                task_id=request.id or "",
                headers={**headers, "retries": retries},
            )
        except DatabaseError as exc:
            logger.warning(
                "the retry could not wait in the outbox; the broker holds it: %s",
                exc,
                extra={"task_name": self.name, "task_id": request.id},
            )
            return False
        return True

    def defer(self, exc: Deferred) -> Retry:
        """Re-publish this job to run after ``exc.retry_in`` plus full jitter, with the same
        retry count, and return the ``Retry`` to raise so this message is acknowledged.

        Custom headers surface on ``self.request`` as attributes and in ``request.headers``,
        and ``signature_from_request`` copies the latter: ``first_deferred_at`` survives every
        deferral and retry. Past ``exc.deadline`` seconds since then, ``exc`` itself is raised
        and ``on_failure`` dead-letters the job with ``exc.dead_letter_reason``."""
        request = self.request
        if request.called_directly or request.is_eager:
            raise exc  # nothing to wait on outside a worker; eager would spin until the deadline
        now = timezone.now()
        first = _header_time(request, "first_deferred_at") or now
        if (now - first).total_seconds() >= exc.deadline:
            logger.warning(
                "job deferred for %.0f s, past its deadline of %.0f s: %s",
                (now - first).total_seconds(),
                exc.deadline,
                exc,
                extra={"task_name": self.name, "task_id": request.id},
            )
            raise exc
        deferrals = int(getattr(request, "deferrals", 0) or 0) + 1
        # In whole seconds, at least one: RabbitMQ's delay queues (Celery's native delayed
        # delivery) count in seconds, and Celery refuses a delay it would round down to none.
        countdown = math.ceil(max(1.0, exc.retry_in + random.uniform(0, exc.jitter)))  # noqa: S311
        headers = {
            **_job_headers(request),
            "first_deferred_at": first.isoformat(),
            "deferrals": deferrals,
        }
        if not self._schedule(countdown=countdown, retries=request.retries, headers=headers):
            signature = self.signature_from_request(
                request, countdown=countdown, retries=request.retries, headers=headers
            )
            try:
                signature.apply_async()
            except Exception as publish_error:
                # Unlike Celery's retry (which drops the message), put it back: if the broker
                # is gone the reject fails too and the visibility timeout redelivers it.
                raise Reject(publish_error, requeue=True) from publish_error
        logger.info(
            "job deferred %.1f s (deferral %d): %s",
            countdown,
            deferrals,
            exc,
            extra={"task_name": self.name, "task_id": request.id, "deferrals": deferrals},
        )
        return Retry(str(exc), exc=exc, when=now + timedelta(seconds=countdown))

    def _first_failed_at(self) -> datetime:
        # A job that was deferred before it ever failed dates its trouble from the deferral.
        times = [
            t
            for t in (
                _header_time(self.request, "first_failed_at"),
                _header_time(self.request, "first_deferred_at"),
            )
            if t is not None
        ]
        return min(times, default=None) or timezone.now()

    def on_failure(
        self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        transient = isinstance(exc, self.autoretry_for)
        reason = DeadLetter.Reason.EXHAUSTED if transient else DeadLetter.Reason.PERMANENT
        reason = getattr(exc, "dead_letter_reason", reason)
        declared = transient or isinstance(exc, (PermanentError, Deferred))
        dead_letter_record(
            task=self.name,
            task_id=task_id,
            args=list(args or ()),
            kwargs=dict(kwargs or {}),
            queue=queues.queue_delivered(self.request.delivery_info, self.name),
            reason=reason,
            exc=exc,
            traceback=str(einfo) if einfo else "",
            attempts=self.request.retries + 1,
            first_failed_at=self._first_failed_at(),
            log_traceback=not declared,
        )


def _job_headers(request: Any) -> dict[str, Any]:
    """The headers a retry or a deferral carries on: the job's own, without those the broker
    added to this delivery (RabbitMQ's ``x-delivery-count``, and the ``x-death`` history of the
    delay queues a retry waited in). RabbitMQ drops, silently, a message dead-lettered into a
    queue its ``x-death`` says it already expired from: a second delay through the same delay
    queue would be lost."""
    return {k: v for k, v in (request.headers or {}).items() if not k.startswith("x-")}


def _delivery_count(request: Any) -> int | None:
    """How many times the broker delivered this message before (RabbitMQ's quorum queues'
    ``x-delivery-count`` header), or None when the broker does not say."""
    value = request.get("x-delivery-count")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _header_time(request: Any, name: str) -> datetime | None:
    value = getattr(request, name, None)
    try:
        return datetime.fromisoformat(value) if value else None
    except (TypeError, ValueError):
        return None
