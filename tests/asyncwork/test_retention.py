"""Retention: raw webhook bodies and headers are cleared after WEBHOOK_BODY_RETENTION_DAYS
whatever the event's state, while the event-id row stays long enough for dedupe; processed
and ignored rows and finished jobs (successful, or failed) go after their own retention, while a
job not finished stays however old; twice is harmless."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from asyncwork.contrib.periodic.retention import JOB_RETENTION_DAYS, retention_purge
from asyncwork.models import Job
from invoicing.models import Invoice
from stack import stripe_events
from stack.process import ROOT
from tests.helpers.stripe import paid_event, post_event
from webhooks.models import WebhookEvent
from webhooks.stripe import webhook_event_reprocess

pytestmark = pytest.mark.django_db(transaction=True)


def delivered(client: Client, event: dict[str, Any], *, days_ago: float) -> WebhookEvent:
    """An event delivered through the real view, then aged."""
    assert post_event(client, stripe_events.encode(event)).status_code == 200
    rows = WebhookEvent.objects.filter(event_id=event["id"])
    rows.update(received_at=timezone.now() - timedelta(days=days_ago))
    return rows.get()


def test_bodies_are_cleared_in_every_state_and_dedupe_still_holds(settings: Any) -> None:
    settings.WEBHOOK_BODY_RETENTION_DAYS = 30
    settings.WEBHOOK_RETENTION_DAYS = 60
    client = Client()
    old_paid = paid_event()
    old = delivered(client, old_paid, days_ago=31)
    old_ignored = delivered(
        client,
        stripe_events.event("customer.created", stripe_events.customer_object()),
        days_ago=45,
    )
    failed = delivered(client, paid_event(), days_ago=40)
    WebhookEvent.objects.filter(pk=failed.pk).update(state=WebhookEvent.State.FAILED, error="x")
    recent = delivered(client, paid_event(), days_ago=29)

    assert retention_purge() == {"webhook_bodies_cleared": 3}
    for row in (old, old_ignored, failed):
        row.refresh_from_db()
        assert (row.body, row.headers) == ("", {})
        assert row.body_cleared_at is not None
    recent.refresh_from_db()
    assert recent.body
    assert recent.headers
    assert recent.body_cleared_at is None
    assert old.state == WebhookEvent.State.PROCESSED  # what happened is still recorded

    # Stripe redelivers the old event: its id still makes it a duplicate; nothing changes.
    invoices, jobs = Invoice.objects.count(), Job.objects.count()
    again = post_event(client, stripe_events.encode(old_paid))
    assert again.status_code == 200
    assert again.json()["duplicate"] is True
    assert (Invoice.objects.count(), Job.objects.count()) == (invoices, jobs)

    # Reprocessing a cleared event says why it cannot, and changes nothing else.
    result = webhook_event_reprocess(event_ids=[old.event_id], actor="test")
    assert result.failed == [old.event_id]
    old.refresh_from_db()
    assert "cleared by retention" in old.error

    # A second run finds nothing left to do.
    assert retention_purge() == {}  # nothing to purge: the rules that touched none left out


def test_rows_go_after_their_own_retention_and_failed_events_stay(settings: Any) -> None:
    settings.WEBHOOK_BODY_RETENTION_DAYS = 1
    settings.WEBHOOK_RETENTION_DAYS = 3
    client = Client()
    gone = delivered(client, paid_event(), days_ago=3.5)
    kept = delivered(client, paid_event(), days_ago=2.5)
    failed = delivered(client, paid_event(), days_ago=10)
    WebhookEvent.objects.filter(pk=failed.pk).update(state=WebhookEvent.State.FAILED)
    # The payments' email jobs, done long ago; and jobs that stay.
    long_ago = timezone.now() - timedelta(days=JOB_RETENTION_DAYS + 1)
    finished = Job.objects.update(
        status=Job.Status.SUCCESSFUL, finished_at=long_ago, published_at=long_ago
    )
    assert finished == 3
    staying: dict[str, dict[str, Any]] = {
        "waiting": {"status": Job.Status.READY},
        "due later": {"status": Job.Status.READY, "due_at": timezone.now() + timedelta(days=1)},
        "running": {"status": Job.Status.RUNNING, "started_at": long_ago},
        "failed lately": {
            "status": Job.Status.FAILED,
            "finished_at": timezone.now() - timedelta(days=JOB_RETENTION_DAYS - 1),
        },
    }
    for task, fields in staying.items():
        job = Job.objects.create(task=task, args=[1], queue="default")
        Job.objects.filter(pk=job.pk).update(created_at=long_ago, **fields)
    failed_long_ago = Job.objects.create(task="failed long ago", queue="default")
    Job.objects.filter(pk=failed_long_ago.pk).update(status=Job.Status.FAILED, finished_at=long_ago)

    done = retention_purge(batch=1)  # batch by batch
    assert done == {"jobs": finished + 1, "webhook_bodies_cleared": 3, "webhook_events": 1}
    assert not WebhookEvent.objects.filter(pk=gone.pk).exists()
    assert WebhookEvent.objects.filter(pk__in=[kept.pk, failed.pk]).count() == 2
    assert set(Job.objects.values_list("task", flat=True)) == set(staying)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("WEBHOOK_RETENTION_DAYS", "2", "WEBHOOK_RETENTION_DAYS must be at least 3"),
        ("WEBHOOK_BODY_RETENTION_DAYS", "0", "WEBHOOK_BODY_RETENTION_DAYS must be at least 1"),
    ],
)
def test_a_retention_shorter_than_dedupe_needs_is_refused(
    variable: str, value: str, message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", variable: value},
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
