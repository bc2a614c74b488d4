"""The broker as the tests read it, whichever one this run uses (``TESTS_BROKER``, in
``tests/settings.py``): Redis, a list per queue under the run's key prefix; RabbitMQ, the
queues of a virtual host of the run's own, created and deleted by the run
(``tests/conftest.py``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import redis
from celery import current_app
from django.conf import settings
from kombu import Connection
from kombu.transport.native_delayed_delivery import level_name

from asyncwork import broker
from asyncwork.backend import RUN, message_id
from asyncwork.broker import queue_keys

# As the machinery reads it: from the broker URL's scheme.
RABBITMQ = broker.rabbitmq()

redis_only = pytest.mark.skipif(RABBITMQ, reason="Redis only: the broker is RabbitMQ")
rabbitmq_only = pytest.mark.skipif(not RABBITMQ, reason="RabbitMQ only: the broker is Redis")

# RabbitMQ: Celery's delay queues (native delayed delivery), one per power of two seconds.
DELAY_QUEUES = tuple(level_name(level) for level in range(28))


# The tests that prove the pipeline through the broker (duplicates, retries and deferrals, dead
# letters and their replay, the crash window and the rescue by heartbeat, the outbox relay, the
# breaker) and the RabbitMQ set-up itself. A run on Redis runs them with every other test;
# TESTS_BROKER=rabbitmq runs only these, on RabbitMQ (make test runs both; tests/conftest.py).
# Within them, a test about one broker's own mechanism says so (redis_only, rabbitmq_only).
BOTH_BROKERS = (
    "tests/asyncwork/test_broker_reads.py",
    "tests/asyncwork/test_deadletters.py",
    "tests/asyncwork/test_held_jobs.py",
    "tests/asyncwork/test_outbox.py",
    "tests/asyncwork/test_rabbitmq.py",
    "tests/asyncwork/test_scheduled.py",
    "tests/invoicing/test_pipeline.py",
    "tests/invoicing/test_crash.py",
    "tests/invoicing/test_rescue.py",
    "tests/invoicing/test_takeover.py",
    "tests/invoicing/test_recovery_queue.py",
    "tests/invoicing/test_breaker_pipeline.py",
    "tests/test_quiescence.py",
)
_ROOT = Path(__file__).resolve().parent.parent.parent


def runs_on_both(path: Path) -> bool:
    """Whether the test module at ``path`` is one of ``BOTH_BROKERS``."""
    return path.resolve().relative_to(_ROOT).as_posix() in BOTH_BROKERS


def vhost_is_the_runs() -> bool:
    """This run made the broker URL (tests/settings.py), so its virtual host is the run's."""
    return settings.TESTS_BROKER == "rabbitmq" and vhost().startswith("test-")


def vhost() -> str:
    """The RabbitMQ virtual host of this run (the broker URL's path)."""
    return unquote(urlsplit(settings.CELERY_BROKER_URL).path.lstrip("/"))


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def vhost_create(name: str) -> None:
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")


def vhost_delete(name: str) -> None:
    rabbitmqctl("delete_vhost", name)


def rabbitmq_queues() -> dict[str, dict[str, Any]]:
    """Every queue of this run's virtual host, by name: its type, arguments, durability, and
    its messages ready and unacknowledged (as ``rabbitmqctl list_queues`` reports them)."""
    columns = ("name", "type", "durable", "arguments", "messages_ready", "messages_unacknowledged")
    out = rabbitmqctl("list_queues", "-p", vhost(), "--formatter", "json", *columns)
    found = {row["name"]: row for row in json.loads(out or "[]")}
    for row in found.values():  # [[name, type, value], ...]
        row["arguments"] = {name: value for name, _, value in row["arguments"]}
    return found


def _amqp() -> Connection:
    return Connection(settings.CELERY_BROKER_URL, connect_timeout=5)


def _rabbitmq_depth(name: str) -> int:
    with _amqp() as conn:
        try:
            channel: Any = conn.default_channel
            return int(channel.queue_declare(name, passive=True).message_count)
        except conn.channel_errors:  # not declared (yet): nothing in it
            return 0


def queue_consumers(name: str) -> int:
    """Consumers on queue ``name`` (RabbitMQ; 0 on Redis, which does not know them)."""
    if not RABBITMQ:
        return 0
    with _amqp() as conn:
        try:
            channel: Any = conn.default_channel
            return int(channel.queue_declare(name, passive=True).consumer_count)
        except conn.channel_errors:
            return 0


def queue_depth(name: str) -> int:
    """Messages waiting on queue ``name`` (not those a worker holds)."""
    if RABBITMQ:
        return _rabbitmq_depth(name)
    key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + name
    return int(redis.Redis.from_url(settings.CELERY_BROKER_URL).llen(key))


def held_unacknowledged() -> int:
    """Messages delivered to a consumer and not yet acknowledged, in every queue of the run
    (Redis: kombu's ``unacked`` hash; RabbitMQ: each queue's unacknowledged count)."""
    if RABBITMQ:
        return sum(int(row["messages_unacknowledged"]) for row in rabbitmq_queues().values())
    key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "unacked"
    return int(redis.Redis.from_url(settings.CELERY_BROKER_URL).hlen(key))


def jobs_in_broker() -> dict[str, int]:
    """The messages of the queues the workers consume (``broker.consumed``) that wait there or
    are delivered to a worker and not yet acknowledged, by queue, leaving out the queues that
    hold none. On Redis, which keeps the unacknowledged messages of every queue in one hash,
    those are counted under ``unacked``. On RabbitMQ the unacknowledged ones are read (with
    ``rabbitmqctl``, about a second) only once no message waits."""
    names = [queue.name for queue in broker.consumed()]
    if RABBITMQ:
        counts = {name: _rabbitmq_depth(name) for name in names}
        if not any(counts.values()):
            found = rabbitmq_queues()
            counts = {
                name: int(row["messages_ready"]) + int(row["messages_unacknowledged"])
                for name, row in found.items()
                if name in names
            }
    else:
        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        counts = {name: sum(client.llen(key) for key in queue_keys(name)) for name in names}
        counts["unacked"] = held_unacknowledged()
    return {name: n for name, n in counts.items() if n}


def queue_messages(name: str) -> list[dict[str, Any]]:
    """The messages waiting on queue ``name``, each as kombu's envelope (``headers``,
    ``body``...), left where they are."""
    if not RABBITMQ:
        key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + name
        raw = redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(key, 0, -1)
        return [json.loads(item) for item in raw]
    found = []
    with _amqp() as conn:
        channel: Any = conn.channel()
        # Taken without acknowledging, then given back when the channel closes.
        while (message := channel.basic_get(name, no_ack=False)) is not None:
            found.append({"headers": message.headers, "body": message.body})
        channel.close()
    return found


def job_message_again(job_id: int, *, queue: str, shadow: str = "") -> None:
    """Publish job ``job_id``'s message once more to ``queue``, as a broker's redelivery brings
    it (the same Celery task and id the outbox gives it; ``shadow``: the name Celery logs)."""
    current_app.send_task(
        RUN, args=[job_id], queue=queue, task_id=message_id(job_id), shadow=shadow or None
    )


def queue_delete(name: str) -> None:
    """Delete queue ``name`` and what it holds (one a test made up)."""
    if not RABBITMQ:
        key = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + name
        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(key)
        return
    with _amqp() as conn:
        channel: Any = conn.default_channel
        channel.queue_delete(name)


def queues_empty() -> None:
    """Empty this run's queues: those the workers consume, dlq, and (RabbitMQ) the delay
    queues, so no message one test left reaches the next test's worker."""
    if not RABBITMQ:
        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        pattern = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "*"
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
        client.close()
        return
    names = [*(queue.name for queue in broker.consumed()), broker.DLQ, *DELAY_QUEUES]
    # Twice, a moment apart: RabbitMQ requeues the unacknowledged messages of a worker that just
    # closed its connection (the previous test's) a moment after it closed.
    for sweep in range(2):
        if sweep:
            time.sleep(0.25)
        with _amqp() as conn:
            for name in names:
                channel: Any = conn.channel()
                # A queue not declared yet holds nothing; asking closes the channel.
                with contextlib.suppress(*conn.channel_errors):
                    channel.queue_purge(name)
                with contextlib.suppress(*conn.channel_errors, *conn.connection_errors):
                    channel.close()
