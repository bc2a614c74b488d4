"""RabbitMQ as the broker (``TESTS_BROKER=rabbitmq``; on Redis these are skipped): the queues
as declared, publisher confirms under the outbox, and a poison job dead-lettered with its
reason. (A retry waits in PostgreSQL on both brokers: test_scheduled.py.)"""

from __future__ import annotations

import signal
import uuid
from typing import Any

import pytest
from django.test import Client
from kombu import Connection

from asyncwork.broker import DLQ, consumed, dlq_declaration
from asyncwork.models import Job
from asyncwork.settings import asyncwork_settings
from core.celery import app
from stack import launch, stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers import broker
from tests.helpers.processes import poison_job_dead_lettered, worker_env, worker_thread
from tests.helpers.stripe import paid_event, post_event

pytestmark = [pytest.mark.django_db(transaction=True), broker.rabbitmq_only]


def test_the_queues_are_durable_quorum_queues_with_a_delivery_limit_onto_dlq() -> None:
    with worker_thread(concurrency=1):
        declared = broker.rabbitmq_queues()
        consumers = broker.rabbitmqctl(
            "list_consumers", "-p", broker.vhost(), "queue_name", "ack_required", "prefetch_count"
        )
    names = [queue.name for queue in consumed()]
    assert {"default", "email"} <= set(names)
    for name in names:
        queue = declared[name]
        assert (queue["type"], queue["durable"]) == ("quorum", True), queue
        arguments = queue["arguments"]
        # Delivered BROKER_DELIVERY_LIMIT times (3 in the tests): RabbitMQ's limit counts the
        # deliveries after the first.
        assert arguments["x-delivery-limit"] == asyncwork_settings.BROKER_DELIVERY_LIMIT - 1
        assert arguments["x-dead-letter-exchange"] == "dlq"
        assert arguments["x-dead-letter-routing-key"] == "dlq"
        # Acknowledged late, one message at a time (a worker of one thread).
        assert f"{name}\ttrue\t1" in consumers.splitlines(), consumers
    # Declared by the worker before anything was dead-lettered onto it.
    assert (declared["dlq"]["type"], declared["dlq"]["durable"]) == ("quorum", True)
    # Celery's delay queues (a countdown: a recovery job dispatched again), classic
    # (core/settings.py says why).
    for name in broker.DELAY_QUEUES:
        assert (declared[name]["type"], declared[name]["durable"]) == ("classic", True), name


def test_the_outbox_marks_a_job_published_only_once_rabbitmq_confirmed_it(
    client: Client, smtp: SmtpServer
) -> None:
    """A queue that refuses messages (full, rejecting publishes): without publisher confirms
    the publish would return, the job be marked published and the message be lost. Once the
    queue takes messages again, a worker's poll publishes the job, alone."""
    policy = f"full-{uuid.uuid4().hex[:6]}"
    broker.rabbitmqctl(
        "set_policy", "-p", broker.vhost(), "--apply-to", "queues", policy, "^email$",
        '{"max-length": 0, "overflow": "reject-publish"}',
    )  # fmt: skip
    try:
        with worker_thread():  # declares the queues, so the policy applies to email
            pass
        # A quorum queue refuses publishes once over its limit: fill it.
        with Connection(app.conf.broker_url, transport_options={"confirm_publish": True}) as conn:
            conn.Producer().publish({"filler": True}, exchange="email", routing_key="email")
        assert post_event(client, stripe_events.encode(paid_event())).status_code == 200
        row = Job.objects.get()
        assert row.published_at is None
        assert row.publish_attempts == 1
        assert row.last_error == "MessageNacked()"  # py-amqp's, for the broker's nack
        # The same publish unconfirmed returns as if the queue had taken it.
        with Connection(app.conf.broker_url) as conn:
            conn.Producer().publish({"lost": True}, exchange="email", routing_key="email")
    finally:
        broker.rabbitmqctl("clear_policy", "-p", broker.vhost(), policy)
    broker.queues_empty()  # the filler
    with worker_thread():
        smtp.handler.wait_for(1, timeout=20)
    row.refresh_from_db()
    assert row.published_at is not None
    assert (row.status, row.publish_attempts) == (Job.Status.SUCCESSFUL, 2)


@pytest.mark.slow
def test_a_poison_job_is_dead_lettered_with_its_reason_not_left_on_dlq(
    smtp_unreachable: int,
) -> None:
    """A job that kills the process running it: run again (its message requeued when the pool
    process is lost, its run given back by the rescue once its owner's heartbeat lapsed) until
    its attempts are spent, when its next claim records the dead letter instead of running it.
    Each run is a message of its own, so RabbitMQ's delivery limit never moves it onto dlq."""
    poison_job_dead_lettered(smtp_unreachable)
    # Recorded once, as the row: its last delivery was acknowledged, nothing went onto dlq.
    assert broker.queue_depth(DLQ) == 0


def test_rabbitmq_moves_a_message_past_its_delivery_limit_onto_dlq() -> None:
    """Should a worker die on the last delivery too, RabbitMQ dead-letters the message onto
    dlq itself (here, returned by a consumer with no worker at all)."""
    default = consumed()[0]
    # Confirmed: a quorum queue takes a message once a majority of its replicas wrote it,
    # and a basic.get right after an unconfirmed publish can come before.
    with Connection(app.conf.broker_url, transport_options={"confirm_publish": True}) as conn:
        channel: Any = conn.channel()
        dlq_declaration()(channel).declare()
        default(channel).declare()
        conn.Producer(channel).publish(
            {"poison": True}, exchange=default.exchange, routing_key=default.routing_key
        )
        for delivery in range(3):  # BROKER_DELIVERY_LIMIT
            message = channel.basic_get(default.name, no_ack=False)
            assert message is not None, delivery
            assert message.headers["x-delivery-count"] == delivery
            channel.basic_reject(message.delivery_tag, requeue=True)
        assert channel.basic_get(default.name, no_ack=False) is None
        channel.close()
    [dead] = broker.queue_messages(DLQ)
    assert dead["headers"]["x-first-death-reason"] == "delivery_limit"
    assert dead["headers"]["x-first-death-queue"] == default.name


def test_a_worker_restarted_under_its_name_starts_while_the_node_holds_its_old_connection(
    smtp_unreachable: int,
) -> None:
    """After a partition the node may still hold the cut worker's connection, and with it the
    worker's remote-control queue (``<name>.celery.pidbox``). Its return under the same name
    must start: with that queue exclusive (Celery's default) it was refused the queue
    (RESOURCE_LOCKED), an unrecoverable error, and exited, at every restart, until the node
    noticed the dead connection (about 70 s after the heal in the chaos run across hosts).
    Here the first worker is stopped with SIGSTOP: its connection stays open, nothing on it
    answers."""
    env = worker_env(smtp_unreachable)
    first = launch.celery_worker(env, name="twin", concurrency=1)
    second = None
    try:
        first.wait_ready()
        first.signal_group(signal.SIGSTOP)
        second = launch.celery_worker(env, name="twin", concurrency=1)
        second.wait_ready(timeout=60)
        # The refusal came as the worker started its remote control, around "ready".
        assert not wait_until(lambda: not second.alive(), timeout=3)
        assert "RESOURCE_LOCKED" not in second.log_text()
    finally:
        first.signal_group(signal.SIGCONT)
        first.stop()
        if second is not None:
            second.stop()
