"""``@reliable_task``, how every job but the scheduled ones (``asyncwork.jobs``) is declared:
a Celery task on ``ReliableTask``, retried as its ``RetryPolicy`` says.

* ``TransientError``, a lost database connection or a soft time limit is retried with backoff and
  full jitter, up to the policy's attempts; anything else, or the last attempt, is dead-lettered
  (``asyncwork.deadletters``), before the message is acknowledged (``acks_late``,
  ``reject_on_worker_lost``).
* ``Deferred`` spends no attempt: ``defer()`` runs the job again after the cool-down, until a
  deadline from the first deferral.
* A retry or deferral waits as an outbox row due later (``outbox_schedule``), not in a worker or
  the broker.
* A declared failure's dead letter logs no traceback (the row has it); any other exception is a
  bug, and its line carries one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from celery import Task, shared_task
from celery.exceptions import Reject, Retry, SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, connection
from django.utils import timezone

from asyncwork import queues
from asyncwork.deadletters import dead_letter_record
from asyncwork.errors import Deferred, PermanentError, RedeliveredTooOften, TransientError
from asyncwork.models import DeadLetter
from asyncwork.outbox import outbox_schedule
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

# A retry's row the database refuses is tried again this often, for this long, before the message
# goes back to its queue: long enough for a PostgreSQL restart, far inside every time limit. On
# RabbitMQ each return counts as a delivery (BROKER_DELIVERY_LIMIT).
RETRY_WRITE_INTERVAL = 1.0
RETRY_WRITE_WAIT = 10.0

T = TypeVar("T")


class ReliableTask(Task):
    autoretry_for = (TransientError, SoftTimeLimitExceeded, OperationalError, InterfaceError)
    retry_jitter = True  # full jitter: randrange(countdown + 1)
    acks_late = True
    reject_on_worker_lost = True
    # on_failure dead-letters every failure and logs it; Celery logs an exception in ``throws`` at
    # INFO without a traceback, so it is not logged twice.
    throws = (Exception,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Messages published by earlier versions named their outbox row in a kwarg (the task id
        # names it): a job's own parameters are its arguments alone.
        kwargs.pop("outbox_id", None)
        # RabbitMQ counts a message's earlier deliveries (Redis does not: no header there).
        delivered = _header(self.request, "x-delivery-count", int)
        if delivered is not None and delivered + 1 >= asyncwork_settings.BROKER_DELIVERY_LIMIT:
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
        """Celery's ``retry`` whose wait is an outbox row (``_schedule``), not a message with an
        ETA. Called directly, eagerly or past ``max_retries``: Celery's own."""
        request = self.request
        limit = self.max_retries if max_retries is None else max_retries
        if (
            request.called_directly
            or request.is_eager
            or (limit is not None and request.retries >= limit)
        ):
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        # Carry the first failure's time (for the dead letter) and the job's other headers (a retry
        # must not restart the deferral deadline).
        headers = {**_job_headers(request), **(options.pop("headers", None) or {})}
        headers.setdefault("first_failed_at", self._first_failed_at().isoformat())
        if options:
            raise TypeError(f"a retry waits as an outbox row, which keeps no {sorted(options)}")
        if eta is not None:
            countdown = max(0.0, (eta - timezone.now()).total_seconds())
        elif countdown is None:
            countdown = self.default_retry_delay
        if isinstance(exc, TransientError) and exc.retry_after:
            # The dependency said when to come back: not sooner (plus up to half again, so the
            # jobs it turned away do not all return at once), nor past the longest wait.
            asked = exc.retry_after * random.uniform(1.0, 1.5)  # noqa: S311
            countdown = max(countdown, min(asked, getattr(self, "retry_backoff_max", 600)))
        self._schedule(
            countdown=countdown,
            retries=request.retries + 1,
            headers=headers,
            args=request.args if args is None else args,
            kwargs=request.kwargs if kwargs is None else kwargs,
        )
        retry = Retry(exc=exc, when=timezone.now() + timedelta(seconds=countdown))
        if throw:
            raise retry
        return retry

    def _schedule(
        self, *, countdown: float, retries: int, headers: dict[str, Any], args: Any, kwargs: Any
    ) -> None:
        """Write this job's next run as an outbox row due in ``countdown`` seconds; still refused
        after ``RETRY_WRITE_WAIT`` (or at the soft time limit), requeue the message unchanged
        (``Reject``): a job is never dropped for want of its retry's row."""
        request = self.request
        if connection.in_atomic_block:
            # Raising Retry would roll the row back with the caller's transaction.
            raise RuntimeError("retry() inside transaction.atomic(): its row would roll back")
        # Onto the queue read ahead of its own: a job that waited out its backoff is older than the
        # backlog queued since.
        queue = queues.queue_ahead(queues.queue_delivered(request.delivery_info, self.name))
        started = time.monotonic()
        try:
            while True:
                try:
                    outbox_schedule(
                        task=self.name,
                        args=list(args or ()),
                        kwargs=dict(kwargs or {}),
                        queue=queue,
                        due_in=max(0.0, countdown - (time.monotonic() - started)),
                        task_id=request.id or "",
                        headers={**headers, "retries": retries},
                    )
                    return
                except DatabaseError as exc:
                    refused: Exception = exc
                connection.close()  # the next try opens a new connection
                if time.monotonic() - started >= RETRY_WRITE_WAIT:
                    break
                time.sleep(RETRY_WRITE_INTERVAL)
        except SoftTimeLimitExceeded as exc:
            refused = exc
        logger.warning(
            "the retry could not be written; the message goes back to its queue: %s",
            refused,
            extra={"task_name": self.name, "task_id": request.id},
        )
        raise Reject(refused, requeue=True) from refused

    def defer(self, exc: Deferred) -> Retry:
        """Write this job's next run after ``exc.retry_in`` plus jitter, same retry count
        (``_schedule``); return the ``Retry`` to raise. Past ``exc.deadline`` seconds since
        ``first_deferred_at`` (a header kept across deferrals and retries), raise ``exc``:
        ``on_failure`` dead-letters it with ``exc.dead_letter_reason``."""
        request = self.request
        if request.called_directly or request.is_eager:
            raise exc  # nothing to wait on outside a worker; eager would spin until the deadline
        now = timezone.now()
        first = _header(request, "first_deferred_at", datetime.fromisoformat) or now
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
        countdown = max(1.0, exc.retry_in + random.uniform(0, exc.jitter))  # noqa: S311
        headers = {
            **_job_headers(request),
            "first_deferred_at": first.isoformat(),
            "deferrals": deferrals,
        }
        self._schedule(
            countdown=countdown,
            retries=request.retries,
            headers=headers,
            args=request.args,
            kwargs=request.kwargs,
        )
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
            _header(self.request, name, datetime.fromisoformat)
            for name in ("first_failed_at", "first_deferred_at")
        ]
        return min((t for t in times if t is not None), default=None) or timezone.now()

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


@dataclass(frozen=True)
class RetryPolicy:
    """How a job retries a transient failure: ``attempts`` runs in all, the first included;
    before run n + 1 it waits ``min(backoff_max, backoff * 2 ** (n - 1))`` seconds, a random part
    of that (full jitter) unless ``jitter`` is off. The defaults: 5 attempts, 2 s doubling to at
    most 10 minutes, jittered."""

    attempts: int = 5
    backoff: int = 2
    backoff_max: int = 600
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff < 1 or self.backoff_max < self.backoff:
            raise ValueError(
                "a retry policy needs attempts >= 1 and 1 <= backoff <= backoff_max (seconds)"
            )


def reliable_task(
    *, name: str, retry: RetryPolicy = RetryPolicy(), **options: Any
) -> Callable[[Callable[..., Any]], Any]:
    """Declare a job: a Celery task on ``ReliableTask`` named ``name``, bound (its first parameter
    is the task), retried as ``retry`` says; ``options`` are Celery's own (``soft_time_limit``,
    ``time_limit``, ...). Its queue is the one whose ``queue_declare`` lists ``name``; what its
    dead letters are about, its ``@dead_letter_describer``."""
    return shared_task(
        name=name,
        bind=True,
        base=ReliableTask,
        max_retries=retry.attempts - 1,  # Celery counts retries, not attempts
        retry_backoff=retry.backoff,
        retry_backoff_max=retry.backoff_max,
        retry_jitter=retry.jitter,
        **options,
    )


def _job_headers(request: Any) -> dict[str, Any]:
    """The headers a retry or deferral carries on: the job's own, without the broker's ``x-``
    headers of this delivery (RabbitMQ silently drops a message dead-lettered into a queue its
    ``x-death`` says it already expired from)."""
    return {k: v for k, v in (request.headers or {}).items() if not k.startswith("x-")}


def _header(request: Any, name: str, parse: Callable[[Any], T]) -> T | None:
    """Header ``name`` of this delivery, parsed; None when absent or unreadable."""
    value = request.get(name)
    try:
        return parse(value) if value is not None else None
    except (TypeError, ValueError):
        return None
