"""The transactional outbox: nothing is published before the state change that caused it commits.

``outbox_enqueue`` writes the intent in the caller's transaction and publishes it from
``transaction.on_commit``. A publish that fails (broker down, stalled past the socket timeout)
leaves the row unpublished and the request unharmed; ``outbox_relay`` publishes such rows later.
The relay and the admin's republish take rows under ``SELECT ... FOR UPDATE SKIP LOCKED``, so
two of them never publish the same row at once; the on-commit publish sends the row it just
wrote without a lock (the relay leaves rows younger than its grace period alone), and leaves
its mark to a thread of its process that writes the marks in batches (``_Marker``). A crash
between publishing and marking published publishes the row again: consumers are idempotent,
so twice is harmless; never is what this prevents.
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

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from celery import current_app
from celery.signals import worker_process_shutdown
from django.conf import settings
from django.db import connections, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError as BrokerError
from prometheus_client import Counter, Histogram

from asyncwork import queues
from asyncwork.db import insert
from asyncwork.models import OutboxMessage
from operators.audit import operator_action_record

logger = logging.getLogger(__name__)

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


# The histogram's child for each queue, looked up once (``labels`` takes a lock and builds a
# key on every call): the on-commit publish observes it for every request that enqueues.
_latency_by_queue: dict[str, Any] = {}


def _published(*, queue: str, created: float) -> None:
    """A row created at ``created`` (seconds since the epoch) was just published."""
    latency = _latency_by_queue.get(queue)
    if latency is None:
        latency = _latency_by_queue[queue] = OUTBOX_PUBLISH_LATENCY.labels(queue=queue)
    latency.observe(max(0.0, time.time() - created))


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


# The columns of an outbox row written by a caller's own statement (``outbox_insert_sql``).
_INSERT_COLUMNS = (
    "task, args, kwargs, queue, created_at, published_at, publish_attempts, last_error, "
    "due_at, task_id, headers"
)


def outbox_insert_sql(*, args: str, rows: str) -> str:
    """The SQL of an ``INSERT`` of one outbox row per row of ``rows`` (a ``SELECT``'s clauses
    from ``FROM`` on), with ``args`` (a jsonb expression over those rows), for the task and
    queue given as the placeholders ``outbox_task`` and ``outbox_queue``
    (``outbox_insert_params``), returning each row's ``id`` and ``created`` (its
    ``created_at`` in seconds since the epoch, which is cheaper to read than a timestamp): the
    outbox row of a caller that writes its state change and its intent in one statement (a
    data-modifying CTE). What it returned goes to ``outbox_enqueued``, which publishes the row
    once it commits."""
    return (
        f"INSERT INTO {OutboxMessage._meta.db_table} ({_INSERT_COLUMNS}) "  # noqa: S608 - no input
        f"SELECT %(outbox_task)s, {args}, '{{}}'::jsonb, %(outbox_queue)s, now(), NULL, 0, '', "
        f"NULL, '', '{{}}'::jsonb {rows} "
        "RETURNING id, extract(epoch FROM created_at)::float8 AS created"
    )


def outbox_insert_params(*, task: str, queue: str | None = None) -> dict[str, str]:
    """The values of ``outbox_insert_sql``'s placeholders: ``task``, on its route's queue
    unless ``queue`` is given (as ``outbox_enqueue``)."""
    return {
        "outbox_task": task,
        "outbox_queue": queues.queue_resolve(queue or queues.queue_for(task)),
    }


def outbox_enqueued(
    *, pk: int, created: float, task: str, args: list[Any], queue: str | None = None
) -> None:
    """An outbox row the caller's statement wrote (``outbox_insert_sql``, which returned its
    ``pk`` and ``created``): published once it commits, as ``outbox_enqueue`` publishes its own
    (at once, when it is committed already: a statement run in autocommit). The relay publishes
    it if this process never does."""
    committed = _Committed(
        pk=pk,
        task=task,
        args=args,
        queue=queues.queue_resolve(queue or queues.queue_for(task)),
        created=created,
    )
    transaction.on_commit(lambda: _publish_committed(committed), robust=True)


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


# The mark of on-commit publishes, written once: it runs for every request that enqueues, and
# the ORM's compiling of the same UPDATE cost more CPU than the statement (bench.webhook_ingest).
# The rows are found by primary key alone, and a row already marked (by the relay, or a
# republish) keeps its mark. A condition on published_at in WHERE would let PostgreSQL read the
# partial index of unpublished rows instead and filter by id: every entry of it, each batch,
# including those of every row marked since the last vacuum and of any backlog.
_MARK_PUBLISHED = (
    f"UPDATE {OutboxMessage._meta.db_table} "  # noqa: S608 - a model's table name, no input
    "SET published_at = coalesce(published_at, now()), "
    "publish_attempts = publish_attempts + (published_at IS NULL)::int "
    "WHERE id = ANY(%s)"
)


def _publish_committed(message: _Committed) -> None:
    """The on-commit publish of a row this process has just committed: no re-read and no row
    lock, and its mark left to this process's marker (``_Marker``), off the request: it runs
    on every request that enqueues. The relay leaves rows younger than its grace period alone,
    and were both to send, the consumers are idempotent."""
    error = _send(message)
    if error is None:
        _published(queue=message.queue, created=message.created)
        if not _marker().add(message.pk):
            _mark_here([message.pk])
    else:
        OutboxMessage.objects.filter(pk=message.pk).update(
            publish_attempts=F("publish_attempts") + 1, last_error=repr(error)[:2000]
        )


def _mark_here(ids: list[int]) -> None:
    """Mark ``ids`` published on this thread's own connection."""
    with connections[OutboxMessage.objects.db].cursor() as cursor:
        cursor.execute(_MARK_PUBLISHED, [ids])


# The marker writes what is pending once this many are, without waiting out its interval.
MARK_BATCH = 200
# Marks pending or being written, at most, per process; past it the request marks its own row.
MARK_PENDING_MAX = 1000
# After a failed write the marker waits this long before it tries the same marks again.
MARK_RETRY_SECONDS = 1.0
# How long an exit waits for the last marks (a database that does not answer must not hold it).
MARK_STOP_TIMEOUT = 5.0


class _Marker:
    """The marks of this process's on-commit publishes, written in batches (one ``UPDATE ...
    WHERE id = ANY(...)``, every ``OUTBOX_MARK_SECONDS`` or once ``MARK_BATCH`` are pending)
    by a thread of its own on a database connection of its own, so that the request which
    published a row does not wait for its mark.

    Why no guarantee weakens: a mark only says the row need not be published again. A mark
    that never lands (the process killed before its thread wrote it, the database failing
    until the exit) leaves a row the relay publishes again once its grace period is over
    (``OUTBOX_RELAY_GRACE_SECONDS``, which outlasts ``OUTBOX_MARK_SECONDS`` by far): a
    duplicate message, which the consumers' claims make harmless, never a lost one. The
    publish itself, its failure and its latency are recorded as before, by the request.

    The request never waits on the marker's database: handing over a mark takes a lock no
    database call is made under. A write that fails is logged and tried again after
    ``MARK_RETRY_SECONDS`` on a new connection. The marks pending or being written are
    bounded (``MARK_PENDING_MAX``): once the thread is that far behind (the database slower
    than the requests), the request marks its own row as it did before the marker, on its own
    connection. Dropping the mark to the relay instead would keep the request fast but turn
    every row past the bound into a duplicate message, republished by the relay onto the
    database and the broker that are already behind; marking in the request makes the
    requests go at the database's pace, which is what they did without the marker.

    One per process, started by its first mark (so after a fork: a child starts its own;
    the parent's pending marks are the parent's to write); ``outbox_marks_stop`` writes what
    is pending and ends the thread, and runs at the process's exit (``atexit``; a Celery pool
    process's exit, which skips ``atexit``, through ``worker_process_shutdown``)."""

    def __init__(self) -> None:
        self.every = settings.OUTBOX_MARK_SECONDS
        self.changed = threading.Condition()
        self.pending: list[int] = []
        self.writing = 0  # marks taken by the thread and not yet written
        self.added = 0  # marks ever handed over
        self.done = 0  # of those, how many the thread has written, in the order handed over
        self.hurry = False  # a flush is waiting: write what is pending now
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="outbox-marker", daemon=True)
        self.thread.start()

    def add(self, pk: int) -> bool:
        """Hand over the mark of row ``pk``; False when the marker takes no more (it is
        ``MARK_PENDING_MAX`` behind, or stopping): the caller marks it."""
        with self.changed:
            if self.stopping or len(self.pending) + self.writing >= MARK_PENDING_MAX:
                return False
            self.pending.append(pk)
            self.added += 1
            if len(self.pending) in (1, MARK_BATCH):  # the thread may be waiting for either
                self.changed.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Write what is pending now; True once every mark handed over before the call is
        written, False if ``timeout`` seconds pass first (the database failing)."""
        with self.changed:
            target = self.added
            self.hurry = True
            self.changed.notify_all()
            return self.changed.wait_for(lambda: self.done >= target, timeout)

    def stop(self, timeout: float) -> bool:
        """Write what is pending (one try) and end the thread; True if every mark was
        written within ``timeout``."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.thread.join(timeout)
        with self.changed:
            return not self.thread.is_alive() and self.done == self.added

    def _run(self) -> None:
        try:
            while self._write_next():
                pass
        finally:
            connections[OutboxMessage.objects.db].close()

    def _write_next(self) -> bool:
        """Wait for marks, write them; False once stopping with nothing left to write."""
        with self.changed:
            self.changed.wait_for(lambda: self.pending or self.stopping)
            # Gather for one interval, unless a batch is full, a flush waits, or it stops.
            self.changed.wait_for(
                lambda: self.hurry or self.stopping or len(self.pending) >= MARK_BATCH,
                self.every,
            )
            if not self.pending:
                return False
            ids, self.pending = self.pending, []
            self.writing, upto, last = len(ids), self.added, self.stopping
            self.hurry = False
        written = self._write(ids)
        with self.changed:
            self.writing = 0
            if written:
                self.done = upto
                self.changed.notify_all()
                return True
            if last:  # the process is exiting: the relay republishes these rows
                return False
            self.pending[:0] = ids
            self.changed.wait_for(lambda: self.hurry or self.stopping, MARK_RETRY_SECONDS)
        return True

    def _write(self, ids: list[int]) -> bool:
        try:
            _mark_here(ids)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the marks to a retry
            connections[OutboxMessage.objects.db].close()  # the next try reconnects
            logger.warning(
                "outbox marks failed; tried again, or the relay republishes the rows",
                extra={"marks": len(ids), "error": repr(exc)},
            )
            return False
        return True


_markers: dict[str, _Marker] = {}  # this process's marker, under "marker" once started
_markers_lock = threading.Lock()


def _marker() -> _Marker:
    """This process's marker, started by the first call."""
    marker = _markers.get("marker")
    if marker is None:
        with _markers_lock:
            marker = _markers.get("marker")
            if marker is None:
                marker = _markers["marker"] = _Marker()
    return marker


def _markers_forget() -> None:
    """In a forked child: the parent's marker thread is not there, nor its lock's holder."""
    global _markers_lock
    _markers.clear()
    _markers_lock = threading.Lock()


os.register_at_fork(after_in_child=_markers_forget)


def outbox_marks_flush(*, timeout: float = 5.0) -> bool:
    """Write the marks this process's on-commit publishes left pending, now; True once every
    one handed over before the call is written, False if ``timeout`` seconds pass first. For
    a caller that reads ``published_at`` of a row it has just published (tests)."""
    marker = _markers.get("marker")
    return marker is None or marker.flush(timeout)


def outbox_marks_stop(*, timeout: float = MARK_STOP_TIMEOUT) -> bool:
    """Write the pending marks and end this process's marker thread, closing its database
    connection; True if all were written within ``timeout`` seconds. The next mark starts a
    new one. Run at the process's exit; what it does not write, the relay republishes."""
    with _markers_lock:
        marker = _markers.pop("marker", None)
    return marker is None or marker.stop(timeout)


atexit.register(outbox_marks_stop)


@worker_process_shutdown.connect
def _pool_process_exit(**kwargs: Any) -> None:
    """A Celery pool process ends with ``os._exit``: ``atexit`` does not run there."""
    outbox_marks_stop()


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
    return _publish(rows, limit=limit or settings.OUTBOX_RELAY_BATCH_SIZE)


def outbox_publish_due(*, limit: int | None = None) -> int:
    """Publish the scheduled rows that have come due (a retry's backoff or a deferral's
    cool-down is over); returns how many. Concurrent callers split the rows between them."""
    rows = OutboxMessage.objects.filter(published_at__isnull=True, due_at__lte=timezone.now())
    return _publish(rows, limit=limit or settings.OUTBOX_RELAY_BATCH_SIZE)


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


def outbox_relay(
    *, grace: timedelta | None = None, batch_size: int | None = None, max_batches: int = 50
) -> int:
    """Publish rows left unpublished past the grace period, batch by batch. Safe to run twice,
    and concurrently: each batch takes only rows no other relay holds."""
    grace = timedelta(seconds=settings.OUTBOX_RELAY_GRACE_SECONDS) if grace is None else grace
    batch_size = batch_size or settings.OUTBOX_RELAY_BATCH_SIZE
    total = 0
    for _ in range(max_batches):
        count = outbox_publish(older_than=grace, limit=batch_size)
        total += count
        if count < batch_size:
            break
    if total:
        logger.info("outbox relay published %d message(s)", total, extra={"published": total})
    return total
