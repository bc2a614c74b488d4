"""The transactional outbox: nothing is published before the state change that caused it commits.

``outbox_enqueue`` writes the row in the caller's transaction and publishes it on commit; a
failed publish leaves the row for ``outbox_relay``. The relay and ``outbox_republish`` take rows
``FOR UPDATE SKIP LOCKED``. Each publish is one ``send_task`` bounded by
``OUTBOX_PUBLISH_TIMEOUT``, confirmed by RabbitMQ before the row is marked; a crash in between
publishes it again, which idempotent consumers absorb.

``outbox_schedule`` writes a row due later (a retry, a deferral), published once due by the
workers' poll (``asyncwork.scheduled``) or the relay: the wait is spent in PostgreSQL, not as an
unacknowledged message a dead worker would hold until Redis's visibility timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from datetime import timedelta
from functools import cache
from typing import Any

from celery import current_app
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError as BrokerError
from prometheus_client import Counter, Histogram

from asyncwork import queues
from asyncwork.audit import operator_action_record
from asyncwork.jobs import job
from asyncwork.models import OutboxMessage
from asyncwork.settings import asyncwork_settings, metric_name

logger = logging.getLogger(__name__)

# Rows per relay batch: drains a backlog quickly, keeps each transaction short. A relay run
# publishes at most RELAY_MAX_BATCHES of them.
RELAY_BATCH_SIZE = 200
RELAY_MAX_BATCHES = 50

# Labelled, so no series is written before a publish; made on first use (their names read the
# settings).


@cache
def outbox_publish_latency() -> Histogram:
    return Histogram(
        metric_name("outbox_publish_latency_seconds"),
        "Seconds from an outbox row's creation to its publish to the broker.",
        ["queue"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600),
    )


@cache
def outbox_publish_failures() -> Counter:
    return Counter(
        metric_name("outbox_publish_failures"),
        "Outbox publishes that failed (broker down or stalled); the relay retries the row.",
        ["queue"],
    )


def _published(message: OutboxMessage) -> None:
    """``message`` was just published: the time since its row was created."""
    age = time.time() - message.created_at.timestamp()
    outbox_publish_latency().labels(queue=message.queue).observe(max(0.0, age))


def outbox_task_id(message_id: int) -> str:
    """The Celery task id of an outbox row's message: every publish of the row shares it."""
    return f"outbox-{message_id}"


def outbox_enqueue(
    *, task: str, args: list[Any], kwargs: dict[str, Any] | None = None, queue: str | None = None
) -> OutboxMessage:
    """Record ``task`` in this transaction, published once it commits (``queue``: its route's)."""
    message = OutboxMessage(
        task=task,
        args=args,
        kwargs=kwargs or {},
        queue=queues.queue_resolve(queue or queues.queue_for(task)),
    )
    message.save(force_insert=True)
    transaction.on_commit(lambda: _publish_committed(message), robust=True)
    return message


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
    """Record ``task`` to be published ``due_in`` seconds from now as task ``task_id`` with
    ``headers`` (the retry count under ``retries``), in the current transaction if any."""
    message = OutboxMessage(
        task=task,
        args=args,
        kwargs=kwargs,
        queue=queue,
        due_at=timezone.now() + timedelta(seconds=due_in),
        task_id=task_id,
        headers=headers or {},
    )
    message.save(force_insert=True)
    return message


# The on-commit mark: a raw UPDATE by primary key, cheaper than compiling QuerySet.update() on
# every enqueueing request. A row marked meanwhile keeps its first publish time.
_MARK_PUBLISHED = (
    f"UPDATE {OutboxMessage._meta.db_table} "  # noqa: S608 - a model's table name, no input
    "SET published_at = coalesce(published_at, now()), publish_attempts = publish_attempts + 1 "
    "WHERE id = %s"
)


def _publish_committed(message: OutboxMessage) -> None:
    """Publish a just-committed row, then mark it: no re-read, no row lock (the relay leaves young
    rows alone). A failed mark leaves the row to the relay: a duplicate message, not a lost one."""
    error = _send(message)
    if error is None:
        _published(message)
        with connection.cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED, [message.pk])
    else:
        OutboxMessage.objects.filter(pk=message.pk).update(
            publish_attempts=F("publish_attempts") + 1, last_error=repr(error)[:2000]
        )


_local = threading.local()


def _producer() -> Any:
    """This thread's producer, on its own connection with short timeouts and one connection attempt:
    a stalled or refusing broker costs a request at most ``OUTBOX_PUBLISH_TIMEOUT``."""
    producer = getattr(_local, "producer", None)
    if producer is None:
        timeout = asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT
        options = {
            **current_app.conf.broker_transport_options,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # The AMQP transport's names for the same bounds.
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
            # One connection attempt: kombu would otherwise retry for seconds.
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": 0,
            "interval_max": 0,
            "connect_retries_timeout": timeout,
        }
        connection = current_app.connection_for_write(transport_options=options)
        # Closed when its thread ends: py-amqp would leave the socket open.
        weakref.finalize(threading.current_thread(), connection.collect)
        producer = _local.producer = current_app.amqp.Producer(connection, auto_declare=False)
    return producer


def _producer_drop() -> None:
    """Drop this thread's producer without a closing handshake (a stalled broker would hold it)."""
    producer = _local.__dict__.pop("producer", None)
    if producer is not None:
        with contextlib.suppress(Exception):
            producer.connection.collect()


def outbox_publish_due() -> int:
    """Publish the retries and deferrals come due; returns how many. Callers split the rows."""
    rows = OutboxMessage.objects.filter(published_at__isnull=True, due_at__lte=timezone.now())
    return _publish(rows, limit=RELAY_BATCH_SIZE)


def outbox_republish(*, ids: Iterable[int], actor: str) -> int:
    """Publish the given rows again, published or not (a message the broker lost after taking it),
    under their task ids; returns how many. A row another publisher holds is skipped, one the
    broker refuses left to the relay; each row's outcome is an operator action of ``actor``."""
    ids = list(ids)
    if not ids:
        return 0
    return _publish(OutboxMessage.objects.filter(pk__in=ids), limit=len(ids), actor=actor)


def _send(message: OutboxMessage) -> Exception | None:
    """Publish one row with ``send_task`` on this thread's producer. Returns the error instead of
    raising it, and drops the producer, whose connection may be half-broken."""
    timeout = asyncwork_settings.OUTBOX_PUBLISH_TIMEOUT
    try:
        current_app.send_task(
            message.task,
            args=list(message.args),
            kwargs=dict(message.kwargs),
            queue=message.queue,
            # A job's first message is named after the row it came from.
            task_id=message.task_id or outbox_task_id(message.pk),
            # A retry's count and the headers its job carries on (asyncwork.tasks).
            retries=int(message.headers.get("retries", 0)),
            headers=message.headers or None,
            producer=_producer(),
            # One try: a row whose publish fails waits for the relay, not the request.
            retry=False,
            # The AMQP transport ignores the socket timeout: these bound the write and the confirm
            # on a stalled RabbitMQ node (Redis ignores them).
            timeout=timeout,
            confirm_timeout=timeout,
            add_to_parent=False,
        )
    except Exception as exc:  # noqa: BLE001 - any publish failure leaves the row for the relay
        _producer_drop()
        outbox_publish_failures().labels(queue=message.queue).inc()
        # For a broker's nack kombu's own error says nothing; its cause does.
        error = exc.__cause__ if isinstance(exc, BrokerError) and exc.__cause__ else exc
        logger.warning(
            "outbox publish failed; the relay will retry",
            extra={"outbox_id": message.pk, "task_name": message.task, "error": repr(error)},
        )
        return error if isinstance(error, Exception) else exc
    return None


def _publish(rows: QuerySet[OutboxMessage], *, limit: int, actor: str | None = None) -> int:
    """Send up to ``limit`` of ``rows`` no other publisher holds, in id order, and mark them
    published, in one transaction. Stops at the first broker failure: every further row would
    wait out the same timeout. With an ``actor``, records each row's outcome."""
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
                _published(message)
        if actor is not None:
            # Every row asked for, including those another publisher held (a plain read does
            # not wait for their locks) and those after a broker failure.
            for message in rows.order_by("pk"):
                operator_action_record(
                    action="outbox.republish",
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
def outbox_relay(*, grace: timedelta | None = None, batch_size: int | None = None) -> int:
    """Publish rows left unpublished past the grace period, batch by batch (concurrent runs split
    them). A scheduled row waits for its due time however old it is."""
    grace = (
        timedelta(seconds=asyncwork_settings.OUTBOX_RELAY_GRACE_SECONDS) if grace is None else grace
    )
    batch_size = batch_size or RELAY_BATCH_SIZE
    total = 0
    for _ in range(RELAY_MAX_BATCHES):
        now = timezone.now()
        rows = OutboxMessage.objects.filter(published_at__isnull=True).filter(
            Q(due_at__isnull=True, created_at__lt=now - grace) | Q(due_at__lte=now)
        )
        count = _publish(rows, limit=batch_size)
        total += count
        if count < batch_size:
            break
    if total:
        logger.info("outbox relay published %d message(s)", total, extra={"published": total})
    return total
