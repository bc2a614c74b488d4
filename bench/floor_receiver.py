"""The floor receiver: the least work any webhook receiver that commits before answering must
do, in Python, as a bare WSGI callable (no framework). A reference arm of the benchmarks,
served by the same gunicorn configuration as the application (``gunicorn
bench.floor_receiver``); never imported by the application.

Per request: verify the ``v1`` HMAC (constant time, timestamp within tolerance), parse the
JSON, run ONE transaction of one statement (insert-or-skip the event; upsert the invoice
without moving it backwards; insert the job row when the invoice becomes paid), commit,
publish the invoice id to the broker through one prebuilt message and one producer per process,
answer 200. On Redis the producer's channel is the one the workers use (``asyncwork.broker``):
kombu's own builds a new Redis client for every command it sends, a cost no design has to
pay. No backpressure, no logging, no metrics, no field checks: what it skips is what the
application pays for on top of the floor. The job row is written published, as the publish
follows at once: no mark, and nothing that reads the job rows in the same database (the
application's backpressure, probes and relay) takes the floor's rows for a backlog.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from kombu import Connection, Producer

FLOOR_TASK = "bench.floor_send"
FLOOR_QUEUE = "email"
TOLERANCE = 300

# One statement, one round trip, one transaction (autocommit). The invoice is upserted only if
# the event was new and never moved backwards (an older event changes nothing); the job row
# (asyncwork's outbox) is written, published, when this statement made the invoice paid.
_STATEMENT = """
WITH event AS (
    INSERT INTO webhooks_webhookevent
        (event_id, type, livemode, api_version, body, headers, received_at, state, error)
    VALUES (%(event_id)s, %(type)s, %(livemode)s, %(api_version)s, %(body)s, '{}', now(),
            'processed', '')
    ON CONFLICT (event_id) DO NOTHING
    RETURNING id
), before AS (
    SELECT status FROM invoicing_invoice WHERE provider_invoice_id = %(invoice)s
), invoice AS (
    INSERT INTO invoicing_invoice AS i
        (provider_invoice_id, number, customer_email, recipient_override, customer_name,
         provider_customer_id, amount_paid, currency, status, hosted_invoice_url, paid_at,
         provider_updated_at, created_at, updated_at)
    SELECT %(invoice)s, %(number)s, %(email)s, '', %(name)s, '', %(amount)s, %(currency)s,
           %(status)s, '', to_timestamp(%(paid_at)s), to_timestamp(%(created)s), now(), now()
    FROM event
    ON CONFLICT (provider_invoice_id) DO UPDATE
        SET status = CASE WHEN i.status = 'paid' THEN 'paid' ELSE EXCLUDED.status END,
            amount_paid = EXCLUDED.amount_paid, paid_at = coalesce(i.paid_at, EXCLUDED.paid_at),
            provider_updated_at = EXCLUDED.provider_updated_at, updated_at = now()
        WHERE i.provider_updated_at <= EXCLUDED.provider_updated_at
    RETURNING id, status
), outbox AS (
    INSERT INTO asyncwork_job
        (task, args, kwargs, queue, backend, status, created_at, published_at,
         publish_attempts, last_error, owner, attempts, worker_ids, errors, context)
    SELECT %(task)s, jsonb_build_array(invoice.id), '{}', %(queue)s, 'default', 'READY',
           now(), now(), 1, '', '', 0, '[]', '[]', '{}'
    FROM invoice
    WHERE invoice.status = 'paid'
      AND coalesce((SELECT status FROM before), '') <> 'paid'
    RETURNING args
)
SELECT (SELECT count(*) FROM event), (SELECT (args ->> 0)::bigint FROM outbox)
"""

_process: dict[str, Any] = {}


def _state() -> dict[str, Any]:
    """This process's connection and producer, made on its first request (after the fork)."""
    if _process.get("pid") != os.getpid():
        database = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
        url = os.environ["CELERY_BROKER_URL"]
        broker = Connection(
            url,
            # As the application's settings choose it (core.settings, CELERY_BROKER_TRANSPORT).
            transport="asyncwork.broker:Transport" if url.startswith("redis://") else None,
            transport_options={"global_keyprefix": os.environ.get("CELERY_BROKER_KEY_PREFIX", "")},
        )
        _process.update(
            pid=os.getpid(),
            database=database,
            # The default exchange: the routing key is the queue, no binding to look up.
            producer=Producer(broker.channel()),
            secret=os.environ["STRIPE_WEBHOOK_SECRET"].encode(),
            origin=f"floor@{os.getpid()}",
        )
    return _process


def _publish(state: dict[str, Any], invoice_id: int) -> None:
    """A Celery protocol-2 message for ``bench.floor_send(invoice_id)``, built here."""
    task_id = str(uuid.uuid4())
    state["producer"].publish(
        [[invoice_id], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
        routing_key=FLOOR_QUEUE,
        serializer="json",
        headers={
            "lang": "py",
            "task": FLOOR_TASK,
            "id": task_id,
            "root_id": task_id,
            "parent_id": None,
            "group": None,
            "retries": 0,
            "eta": None,
            "expires": None,
            "argsrepr": f"[{invoice_id}]",
            "kwargsrepr": "{}",
            "origin": state["origin"],
            "ignore_result": True,
        },
        correlation_id=task_id,
        delivery_mode=2,
    )


def _verified(secret: bytes, header: str, body: bytes) -> bool:
    items = [item.partition("=") for item in header.split(",")]
    stamps = [value for key, _, value in items if key == "t"]
    if len(stamps) != 1 or not stamps[0].isdigit():
        return False
    if abs(int(stamps[0]) - time.time()) > TOLERANCE:
        return False
    expected = hmac.new(secret, stamps[0].encode() + b"." + body, hashlib.sha256).hexdigest()
    return any(key == "v1" and hmac.compare_digest(value, expected) for key, _, value in items)


Respond = Callable[[str, list[tuple[str, str]]], Any]


def _answer(start_response: Respond, status: str, body: bytes) -> list[bytes]:
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    )
    return [body]


def application(environ: dict[str, Any], start_response: Respond) -> Iterable[bytes]:
    state = _state()
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    if not _verified(state["secret"], environ.get("HTTP_STRIPE_SIGNATURE", ""), body):
        return _answer(start_response, "400 Bad Request", b'{"error": "no signature matches"}')
    event = json.loads(body)
    invoice = event["data"]["object"]
    new, to_publish = (
        state["database"]
        .execute(
            _STATEMENT,
            {
                "event_id": event["id"],
                "type": event["type"],
                "livemode": event["livemode"],
                "api_version": event.get("api_version") or "",
                "body": body.decode(),
                "invoice": invoice["id"],
                "number": invoice.get("number") or "",
                "email": invoice.get("customer_email") or "",
                "name": invoice.get("customer_name") or "",
                "amount": invoice.get("amount_paid") or 0,
                "currency": invoice.get("currency") or "",
                "status": invoice.get("status") or "paid",
                "paid_at": (invoice.get("status_transitions") or {}).get("paid_at"),
                "created": event["created"],
                "task": FLOOR_TASK,
                "queue": FLOOR_QUEUE,
            },
        )
        .fetchone()
    )
    if to_publish is not None:
        _publish(state, to_publish)
    return _answer(
        start_response,
        "200 OK",
        b'{"received": true, "duplicate": %s}' % (b"false" if new else b"true"),
    )
