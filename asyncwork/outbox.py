"""The transactional outbox: nothing is published before the state change that caused it commits.

``outbox_enqueue`` writes the intent in the caller's transaction and publishes it from
``transaction.on_commit``. A publish that fails (broker down, stalled past the socket timeout)
leaves the row unpublished and the request unharmed; ``outbox_relay`` publishes such rows later.
The relay and the admin's republish take rows under ``SELECT ... FOR UPDATE SKIP LOCKED``, so
two of them never publish the same row at once; the on-commit publish sends the row it just
wrote without a lock (the relay leaves rows younger than its grace period alone), then marks
it. Every publish is Celery's ``send_task`` on a producer kept per thread, bounded by
``OUTBOX_PUBLISH_TIMEOUT`` and tried once; on RabbitMQ it returns once the broker confirmed the
message (publisher confirms), so a row is marked published only after the broker took it. A
crash between publishing and marking published publishes the row again: consumers are
idempotent, so twice is harmless; never is what this prevents.
``outbox_republish`` (the admin's "Republish") sends chosen rows again through the same path,
for a message the broker lost after it was marked published, and records what became of each
as an operator action.

A row can also wait: ``outbox_schedule`` writes a job's retry or deferral with a due time
(``due_at``) and the headers it carries on, and nothing publishes it before then. The workers
publish rows as they come due (``outbox_publish_due``, polled by ``asyncwork.scheduled``) and
the relay takes any a poll missed. So the wait is spent in PostgreSQL, not as a message held
unacknowledged by a worker, which on Redis would come back only after the visibility timeout
if that worker died (``asyncwork.tasks``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError as BrokerError
from prometheus_client import Counter, Histogram

from asyncwork import queues
from asyncwork.db import insert
from asyncwork.jobs import job
from asyncwork.models import OutboxMessage
from operators.audit import operator_action_record

logger = logging.getLogger(__name__)

# Rows one relay batch publishes: big enough to drain a backlog quickly, small enough that a
# batch's transaction stays short.
RELAY_BATCH_SIZE = 200

# Counted where the publish happens (the web process, the workers); served by /metrics and the
# workers' metrics port (asyncwork.metrics). Labelled: importing this writes nothing.
OUTBOX_PUBLISH_LATENCY = Histogram(
    "invoicing_outbox_publish_latency_seconds",
    "Seconds from an outbox row's creation to its publish to the broker.",
    ["queue"],
    # On-commit publishes take milliseconds; the relay's come after its grace period.
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
)
OUTBOX_PUBLISH_FAILURES = Counter(
    "invoicing_outbox_publish_failures",
    "Outbox publishes that failed (broker down or stalled); the relay retries the row.",
    ["queue"],
)


def _published(*, queue: str, created: float) -> None:
    """A row created at ``created`` (seconds since the epoch) was just published."""
    OUTBOX_PUBLISH_LATENCY.labels(queue=queue).observe(max(0.0, time.time() - created))


def _publish_failed(*, queue: str) -> None:
    OUTBOX_PUBLISH_FAILURES.labels(queue=queue).inc()


def outbox_task_id(message_id: int) -> str:
    """The Celery task id of an outbox row's message: every publish of the row shares it."""
    return f"outbox-{message_id}"


def outbox_enqueue(
    *, task: str, args: list[Any], kwargs: dict[str, Any] | None = None, queue: str | None = None
) -> OutboxMessage:
    """Record the intent to run ``task`` in the current transaction; publish once it commits.

    ``queue`` defaults to the task's route (``asyncwork.queues``)."""
    message = OutboxMessage(
        task=task,
        args=args,
        kwargs=kwargs or {},
        queue=queues.queue_resolve(queue or queues.queue_for(task)),
    )
    insert(message)  # the ORM's create(), through a statement built once
    committed = _Committed(
        pk=message.pk,
        task=message.task,
        args=message.args,
        kwargs=message.kwargs,
        queue=message.queue,
        created=message.created_at.timestamp(),
    )
    transaction.on_commit(lambda: _publish_committed(committed), robust=True)
    return message


class _Message(Protocol):
    """What a publish reads of a row: an ``OutboxMessage``, or a ``_Committed``."""

    @property
    def pk(self) -> Any: ...
    @property
    def task(self) -> str: ...
    @property
    def args(self) -> list[Any]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...
    @property
    def queue(self) -> str: ...
    @property
    def task_id(self) -> str: ...
    @property
    def headers(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class _Committed:
    """A first message of a row this process has just committed, as its on-commit publish
    reads it: not a model instance, whose signals and field set-up cost more than the rest of
    what the publish does in Python. ``created``: the row's creation, seconds since the epoch."""

    pk: int
    task: str
    args: list[Any]
    queue: str
    created: float
    kwargs: dict[str, Any] = field(default_factory=dict)
    task_id: str = ""
    headers: dict[str, Any] = field(default_factory=dict)


def outbox_schedule(
    *,
    task: str,
    args: list[Any],
    kwargs: dict[str, Any],
    queue: str,
    due_in: float,
    task_id: str = "",
    headers: dict[str, Any] | None = None,
) -> OutboxMessage:
    """Record ``task`` to be published ``due_in`` seconds from now (by this process's clock,
    as the pollers read it), as task ``task_id`` with ``headers`` (its retry count under
    ``retries``) and ``kwargs`` as they are: a retry's or a deferral's wait, or a rescued job
    (due at once). In the current transaction, if any; nothing publishes it before it is due
    (``outbox_publish_due``, ``outbox_relay``)."""
    message = OutboxMessage(
        task=task,
        args=args,
        kwargs=kwargs,
        queue=queue,
        due_at=timezone.now() + timedelta(seconds=due_in),
        task_id=task_id,
        headers=headers or {},
    )
    insert(message)
    return message


# The mark of an on-commit publish: one statement by primary key, run by every request that
# enqueues, where QuerySet.update() compiling the same UPDATE costs several times the
# statement's CPU (docs/performance.md). A row marked meanwhile (by the relay, or a republish)
# keeps the time of its first publish.
_MARK_PUBLISHED = (
    f"UPDATE {OutboxMessage._meta.db_table} "  # noqa: S608 - a model's table name, no input
    "SET published_at = coalesce(published_at, now()), publish_attempts = publish_attempts + 1 "
    "WHERE id = %s"
)


def _publish_committed(message: _Committed) -> None:
    """The on-commit publish of a row this process has just committed, then its mark: no
    re-read and no row lock. The relay leaves rows younger than its grace period alone, and
    were both to send, the consumers are idempotent. A mark that fails (the database gone
    since the commit) leaves the row to the relay: a duplicate message, never a lost one."""
    error = _send(message)
    if error is None:
        _published(queue=message.queue, created=message.created)
        with connection.cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED, [message.pk])
    else:
        OutboxMessage.objects.filter(pk=message.pk).update(
            publish_attempts=F("publish_attempts") + 1, last_error=repr(error)[:2000]
        )


_local = threading.local()


def _producer() -> Any:
    """This thread's producer, on a broker connection of its own with short timeouts: a
    stalled broker costs a request at most ``OUTBOX_PUBLISH_TIMEOUT``, not the worker-side
    timeout (kombu's publish otherwise blocks while it retries the connection)."""
    producer = getattr(_local, "producer", None)
    if producer is None:
        timeout = settings.OUTBOX_PUBLISH_TIMEOUT
        options = {
            **current_app.conf.broker_transport_options,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # The AMQP transport's own names for the same bounds (RabbitMQ).
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
            # One connection attempt, no waiting between retries: a broker that refuses
            # connections fails the publish at once (kombu would otherwise retry for seconds).
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": 0,
            "interval_max": 0,
            "connect_retries_timeout": timeout,
        }
        connection = current_app.connection_for_write(transport_options=options)
        # Closed when its thread is gone (a thread pool's worker thread that ended): py-amqp
        # leaves a socket nobody closed open otherwise.
        weakref.finalize(threading.current_thread(), connection.collect)
        producer = _local.producer = current_app.amqp.Producer(connection, auto_declare=False)
    return producer


def _producer_drop() -> None:
    """Forget this thread's producer after a failed publish, and its connection without the
    closing handshake (``collect``, not ``release``): a stalled broker would hold that too."""
    producer = _local.__dict__.pop("producer", None)
    if producer is not None:
        with contextlib.suppress(Exception):
            producer.connection.collect()


def outbox_publish(
    *,
    ids: Iterable[int] | None = None,
    older_than: timedelta | None = None,
    limit: int | None = None,
) -> int:
    """Publish unpublished rows (those in ``ids``, or those older than ``older_than``).

    Returns how many were published. Stops at the first broker failure: the broker is down or
    stalled, and every further row would wait out the same timeout.
    """
    rows = OutboxMessage.objects.filter(published_at__isnull=True)
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    if older_than is not None:
        # A row scheduled for later waits for its due time, however old it is; one that came
        # due is published at once (no on-commit publish of its own to make way for).
        now = timezone.now()
        rows = rows.filter(
            Q(due_at__isnull=True, created_at__lt=now - older_than) | Q(due_at__lte=now)
        )
    return _publish(rows, limit=limit or RELAY_BATCH_SIZE)


def outbox_publish_due(*, limit: int | None = None) -> int:
    """Publish the scheduled rows that have come due (a retry's backoff or a deferral's
    cool-down is over); returns how many. Concurrent callers split the rows between them."""
    rows = OutboxMessage.objects.filter(published_at__isnull=True, due_at__lte=timezone.now())
    return _publish(rows, limit=limit or RELAY_BATCH_SIZE)


OUTBOX_REPUBLISH = "outbox.republish"


def outbox_republish(*, ids: Iterable[int], actor: str) -> int:
    """Publish the given rows again, published or not: for a message the broker lost after
    taking it (a Redis restart without persistence). Same path as every publish, so a row
    another publisher holds is skipped, and the message keeps its task id; consumers are
    idempotent, so a message that was not lost after all runs as a no-op. Returns how many
    were published; a row the broker refuses is marked unpublished, for the relay. What
    became of each row is recorded as an operator action of ``actor``."""
    ids = list(ids)
    if not ids:
        return 0
    return _publish(OutboxMessage.objects.filter(pk__in=ids), limit=len(ids), actor=actor)


def _send(message: _Message) -> Exception | None:
    """Publish one row's message with Celery's ``send_task`` on this thread's producer; return
    the error instead of raising it (and drop the producer, whose connection may be
    half-broken). Celery's publish signals fire as for any task: ``before_task_publish``
    carries the log context in a header (``asyncwork.logging``)."""
    # A job's first message names the row it came from; a retry's keeps its kwargs as they were.
    kwargs = (
        dict(message.kwargs) if message.task_id else {**message.kwargs, "outbox_id": message.pk}
    )
    timeout = settings.OUTBOX_PUBLISH_TIMEOUT
    try:
        current_app.send_task(
            message.task,
            args=list(message.args),
            kwargs=kwargs,
            queue=message.queue,
            task_id=message.task_id or outbox_task_id(message.pk),
            # A retry's count and the headers its job carries on (asyncwork.tasks).
            retries=int(message.headers.get("retries", 0)),
            headers=message.headers or None,
            producer=_producer(),
            # One try: a row whose publish fails waits for the relay, not the request.
            retry=False,
            # On RabbitMQ the socket timeout of the connection options is not the AMQP
            # transport's: without these a stalled node holds the publish (and the request
            # that commits it) until it answers, waiting for the write or for the confirm.
            # The Redis transport ignores them (its socket timeout bounds it).
            timeout=timeout,
            confirm_timeout=timeout,
            # Nothing reads the relay's results: no trail of them on the relay's own task.
            add_to_parent=False,
        )
    except Exception as exc:  # noqa: BLE001 - any publish failure leaves the row for the relay
        _producer_drop()
        _publish_failed(queue=message.queue)
        # kombu re-raises the transport's error as its own, which for a broker's nack says
        # nothing: the transport's names what happened.
        error = exc.__cause__ if isinstance(exc, BrokerError) and exc.__cause__ else exc
        logger.warning(
            "outbox publish failed; the relay will retry",
            extra={"outbox_id": message.pk, "task_name": message.task, "error": repr(error)},
        )
        return error if isinstance(error, Exception) else exc
    return None


def _publish(rows: QuerySet[OutboxMessage], *, limit: int, actor: str | None = None) -> int:
    """Send up to ``limit`` of ``rows`` that no other publisher holds, in id order, and mark
    those sent published, in one transaction; stop at the first broker failure. With an
    ``actor`` (an operator's republish), what became of each row is recorded."""
    published: list[int] = []
    outcomes: dict[int, str] = {}
    with transaction.atomic():
        batch = list(rows.select_for_update(skip_locked=True).order_by("pk")[:limit])
        for message in batch:
            error = _send(message)
            if error is not None:
                # Unpublished again (a failed republish, too), so the relay takes it over.
                OutboxMessage.objects.filter(pk=message.pk).update(
                    published_at=None,
                    publish_attempts=F("publish_attempts") + 1,
                    last_error=repr(error)[:2000],
                )
                outcomes[message.pk] = f"broker refused, left to the relay: {error!r}"
                break
            published.append(message.pk)
            outcomes[message.pk] = "published"
            if message.published_at is None:  # a republish is not a publish's latency
                _published(queue=message.queue, created=message.created_at.timestamp())
        if actor is not None:
            # Every row asked for, including those another publisher held (a plain read does
            # not wait for their locks) and those after a broker failure.
            for message in rows.order_by("pk"):
                operator_action_record(
                    action=OUTBOX_REPUBLISH,
                    actor=actor,
                    target=message,
                    detail=outcomes.get(message.pk)
                    or (
                        "not sent: the broker failed on an earlier message"
                        if message in batch
                        else "skipped: another publisher holds it"
                    ),
                )
        if published:
            OutboxMessage.objects.filter(pk__in=published).update(
                published_at=timezone.now(), publish_attempts=F("publish_attempts") + 1
            )
    return len(published)


@job("outbox-relay", every=timedelta(seconds=15))
def outbox_relay(
    *, grace: timedelta | None = None, batch_size: int | None = None, max_batches: int = 50
) -> int:
    """Publish rows left unpublished past the grace period, batch by batch. Safe to run twice,
    and concurrently: each batch takes only rows no other relay holds."""
    grace = timedelta(seconds=settings.OUTBOX_RELAY_GRACE_SECONDS) if grace is None else grace
    batch_size = batch_size or RELAY_BATCH_SIZE
    total = 0
    for _ in range(max_batches):
        count = outbox_publish(older_than=grace, limit=batch_size)
        total += count
        if count < batch_size:
            break
    if total:
        logger.info("outbox relay published %d message(s)", total, extra={"published": total})
    return total
