"""Backpressure on POST /webhooks/stripe/ with a real backlog: jobs waiting to be published in
PostgreSQL and real Celery messages waiting on the broker's ``email`` queue in Redis."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from asyncwork.backend import RUN
from asyncwork.broker import queue_keys
from asyncwork.contrib.backpressure import pressure_measure, queues_probe
from asyncwork.models import Job
from core.celery import app
from invoicing.models import Invoice
from invoicing.tasks import EMAIL_QUEUE, send_invoice_email
from stack import stripe_events
from stack.net import free_port
from tests.helpers.stripe import paid_event, post_event
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db


def queue_depth(name: str) -> int:
    """Messages waiting on queue ``name``, as backpressure reads them (every priority)."""
    return queues_probe((name,)).depths[name]


@pytest.fixture
def marks(settings: Any) -> Any:
    """Low marks, and a fresh measurement on every request."""
    settings.ASYNCWORK = {
        **settings.ASYNCWORK,
        "BACKPRESSURE_CHECK_SECONDS": 0,
        "BACKPRESSURE_SOFT_MARK": 5,
        "BACKPRESSURE_HARD_MARK": 20,
    }
    return settings


@pytest.fixture
def quiet_email_queue(settings: Any) -> None:
    """Measure an email queue of this test's own, empty: messages that earlier tests' commits
    published stay on the run's queue and would add to the backlog."""
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        **options,
        "global_keyprefix": f"{options['global_keyprefix']}{uuid.uuid4().hex[:8]}:",
    }
    assert queue_depth(EMAIL_QUEUE) == 0


def backlog(count: int, *, due_at: Any = None) -> None:
    """Unpublished jobs, as a broker outage leaves them (no on-commit publish); with
    ``due_at``, jobs waiting for that time (``run_after``, a retry's backoff)."""
    Job.objects.bulk_create(
        Job(task=send_invoice_email.module_path, args=[n], queue=EMAIL_QUEUE, due_at=due_at)
        for n in range(count)
    )


def ignored_event() -> dict[str, Any]:
    return stripe_events.event("customer.created", stripe_events.customer_object())


def deliver(client: Client, event: dict[str, Any]) -> Any:
    return post_event(client, stripe_events.encode(event))


def stored(event: dict[str, Any]) -> bool:
    return WebhookEvent.objects.filter(event_id=event["id"]).exists()


def test_below_the_soft_mark_everything_is_taken(
    client: Client, marks: Any, quiet_email_queue: None
) -> None:
    backlog(4)
    # Waiting for their time, not for the broker: no backlog until due.
    backlog(30, due_at=timezone.now() + timedelta(hours=1))
    event = ignored_event()
    assert deliver(client, event).status_code == 200
    assert stored(event)


def test_at_the_soft_mark_ignored_types_are_shed_and_payments_taken(
    client: Client, marks: Any, quiet_email_queue: None
) -> None:
    backlog(5)
    ignored, payment = ignored_event(), paid_event("in_bp_soft")

    shed = deliver(client, ignored)
    taken = deliver(client, payment)

    assert shed.status_code == 503
    assert shed.json() == {"error": "overloaded"}
    assert int(shed["Retry-After"]) > 0
    assert not stored(ignored)
    # The payment is stored durably, with its invoice and its job, before the 200.
    assert taken.status_code == 200
    assert stored(payment)
    assert Invoice.objects.filter(provider_invoice_id="in_bp_soft").exists()
    assert Job.objects.filter(published_at__isnull=True).count() == 6


def test_at_the_hard_mark_everything_is_shed(
    client: Client, marks: Any, quiet_email_queue: None
) -> None:
    backlog(20)
    payment, ignored = paid_event("in_bp_hard"), ignored_event()

    responses = [deliver(client, payment), deliver(client, ignored)]

    assert [r.status_code for r in responses] == [503, 503]
    assert all(int(r["Retry-After"]) > 0 for r in responses)
    assert not WebhookEvent.objects.exists()
    assert not Invoice.objects.exists()
    assert Job.objects.count() == 20


def test_a_duplicate_of_a_stored_payment_is_shed_at_the_hard_mark_without_harm(
    client: Client, marks: Any, quiet_email_queue: None
) -> None:
    payment = paid_event("in_bp_dup")
    body = stripe_events.encode(payment)
    assert post_event(client, body).status_code == 200
    backlog(20)
    assert post_event(client, body).status_code == 503
    assert WebhookEvent.objects.filter(event_id=payment["id"]).count() == 1


def test_the_level_is_measured_at_most_once_per_interval(
    client: Client, marks: Any, quiet_email_queue: None
) -> None:
    assert deliver(client, ignored_event()).status_code == 200  # measured now: no backlog
    marks.ASYNCWORK = {**marks.ASYNCWORK, "BACKPRESSURE_CHECK_SECONDS": 60}
    assert deliver(client, ignored_event()).status_code == 200
    backlog(5)

    cached = deliver(client, ignored_event())  # within the interval: the last figures hold
    marks.ASYNCWORK = {**marks.ASYNCWORK, "BACKPRESSURE_CHECK_SECONDS": 0}
    remeasured = deliver(client, ignored_event())

    assert (cached.status_code, remeasured.status_code) == (200, 503)


# --- The email queue, in the broker -------------------------------------------------------------


def broker() -> redis.Redis:
    return redis.Redis.from_url(django_settings.CELERY_BROKER_URL)


@pytest.fixture
def email_messages() -> Iterator[Callable[..., None]]:
    """Publish real Celery messages to the ``email`` queue, as the outbox publishes a job (under
    this run's key prefix, and at several priorities); remove exactly those afterwards."""
    task_ids: set[str] = set()

    def publish(count: int, *, priority: int | None = None) -> None:
        for _ in range(count):
            result = app.send_task(
                RUN,
                args=[0],
                queue=EMAIL_QUEUE,
                priority=priority,
                shadow=send_invoice_email.module_path,
            )
            task_ids.add(result.id)

    yield publish
    client = broker()
    for key in queue_keys(EMAIL_QUEUE):
        for raw in client.lrange(key, 0, -1):
            if json.loads(raw)["headers"]["id"] in task_ids:
                # The bytes read back are what LREM matches; redis-py's stubs say str only.
                client.lrem(key, 1, raw)  # type: ignore[arg-type]


def test_email_queue_depth_counts_every_priority_under_the_key_prefix(
    email_messages: Callable[..., None],
) -> None:
    prefix = django_settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"]
    assert prefix  # the test run's own: the depth read must include it
    before = queue_depth(EMAIL_QUEUE)

    email_messages(3)
    email_messages(4, priority=9)

    assert queue_depth(EMAIL_QUEUE) == before + 7
    # The prioritised messages sit in a key of their own, which a bare LLEN would miss.
    assert broker().llen(prefix + EMAIL_QUEUE) < before + 7


def test_a_deep_email_queue_sheds_ignored_types(
    client: Client, marks: Any, email_messages: Callable[..., None]
) -> None:
    before = queue_depth(EMAIL_QUEUE)  # messages earlier tests' commits published
    marks.ASYNCWORK = {
        **marks.ASYNCWORK,
        "BACKPRESSURE_SOFT_MARK": before + 6,
        "BACKPRESSURE_HARD_MARK": before + 100,
    }
    email_messages(5)
    assert deliver(client, ignored_event()).status_code == 200

    email_messages(1, priority=6)
    ignored, payment = ignored_event(), paid_event()
    shed, taken = deliver(client, ignored), deliver(client, payment)

    assert (shed.status_code, taken.status_code) == (503, 200)
    assert (stored(ignored), stored(payment)) == (False, True)


def test_an_unmeasurable_backlog_sheds_nothing(client: Client, marks: Any) -> None:
    marks.CELERY_BROKER_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    marks.ASYNCWORK = {**marks.ASYNCWORK, "BACKPRESSURE_SOFT_MARK": 1}
    event = ignored_event()
    assert deliver(client, event).status_code == 200
    assert stored(event)


def test_the_outbox_backlog_is_one_count_stopped_at_the_hard_mark(marks: Any) -> None:
    """Each measurement reads the outbox once: the waiting rows counted up to the hard mark,
    so however large a broker outage's backlog grows, no more than the mark's rows are read
    (and not the probes' oldest row, an ordering of the whole backlog)."""
    backlog(25)  # past the hard mark (20)
    with CaptureQueriesContext(connection) as queries:
        pressure = pressure_measure()
    assert pressure.outbox_backlog == 20
    outbox = [q["sql"] for q in queries if Job._meta.db_table in q["sql"]]
    assert len(outbox) == 1, outbox
    assert "LIMIT 20" in outbox[0]
    assert "ORDER BY" not in outbox[0]
