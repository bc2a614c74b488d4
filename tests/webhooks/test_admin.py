"""The webhook events admin: read-only deliveries as received, their verdict, and a
"Reprocess" action that applies an event once however often it is pressed, offered only with
its permission and recorded as an operator action each time."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.models import Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import send_invoice_email
from stack import stripe_events
from stack.smtp import SmtpServer
from tests.helpers.admin import action_choices, admin_as, messages, rows, run_action
from tests.helpers.factories import staff_user
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import paid_event, post_event
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)

EVENTS = "/admin/webhooks/webhookevent/"


def stored(event: dict[str, Any], *, body: bytes | None = None, **fields: Any) -> WebhookEvent:
    """A delivery stored as the view stores it, in the state ``fields`` say (as an earlier
    failure would have left it)."""
    body = body if body is not None else stripe_events.encode(event)
    header = stripe_events.signature_header(body, "whsec_test_primary")
    return WebhookEvent.objects.create(
        event_id=event["id"],
        type=event["type"],
        body=body.decode(),
        headers={"Stripe-Signature": header, "User-Agent": "Stripe/1.0"},
        **{"state": WebhookEvent.State.FAILED, **fields},
    )


def invoice_state(invoice: Invoice) -> tuple[Any, ...]:
    invoice.refresh_from_db()
    return (
        invoice.status,
        invoice.amount_paid,
        invoice.customer_email,
        invoice.paid_at,
        invoice.provider_updated_at,
    )


def test_pages_show_verdict_body_and_headers_read_only(client: Client, staff: Client) -> None:
    paid = paid_event(customer_email="jenny@example.com")
    other = stripe_events.event("customer.created", stripe_events.customer_object())
    post_event(client, stripe_events.encode(paid), HTTP_USER_AGENT="Stripe/1.0")
    post_event(client, stripe_events.encode(other))
    broken = stored(
        stripe_events.event("invoice.paid", {}), error="data.object.id is missing", body=b"{}"
    )

    listed = {row["event_id"]: row for row in rows(staff.get(EVENTS))}
    assert (listed[paid["id"]]["type"], listed[paid["id"]]["verdict"]) == (
        "invoice.paid",
        "processed",
    )
    assert listed[other["id"]]["verdict"] == "ignored"
    assert listed[broken.event_id]["verdict"] == "failed"
    assert listed[broken.event_id]["error_short"] == "data.object.id is missing"
    assert [r["event_id"] for r in rows(staff.get(EVENTS, {"q": paid["id"]}))] == [paid["id"]]
    assert [r["event_id"] for r in rows(staff.get(EVENTS, {"state": "failed"}))] == [
        broken.event_id
    ]

    row = WebhookEvent.objects.get(event_id=paid["id"])
    detail = staff.get(f"{EVENTS}{row.pk}/change/")
    assert detail.status_code == 200
    page = detail.content.decode()
    assert "<pre" in page
    assert "&quot;customer_email&quot;: &quot;jenny@example.com&quot;" in page
    assert f"Stripe-Signature: {row.headers['Stripe-Signature']}" in page
    assert "User-Agent: Stripe/1.0" in page
    assert 'name="_save"' not in page  # read-only
    assert staff.post(f"{EVENTS}{row.pk}/delete/").status_code == 403


def test_a_compact_body_is_shown_pretty_printed(staff: Client) -> None:
    event = stripe_events.event("customer.created", stripe_events.customer_object())
    row = stored(event, body=b'{"id":"%s","type":"customer.created"}' % event["id"].encode())
    page = staff.get(f"{EVENTS}{row.pk}/change/").content.decode()
    assert f"{{\n  &quot;id&quot;: &quot;{event['id']}&quot;,\n  &quot;type&quot;" in page


def test_reprocessing_an_applied_event_twice_changes_nothing(client: Client, staff: Client) -> None:
    event = paid_event()
    post_event(client, stripe_events.encode(event))
    row = WebhookEvent.objects.get()
    invoice = Invoice.objects.get()
    before = invoice_state(invoice)

    for _ in range(2):
        response = run_action(staff, EVENTS, "reprocess_selected", [row.pk])
        assert messages(response) == [
            ("success", "Reprocessed 1 webhook event(s): 1 processed, 0 ignored, 0 failed.")
        ]
        assert invoice_state(invoice) == before

    assert Job.objects.count() == 1  # the email was asked for once, on arrival
    row.refresh_from_db()
    assert (row.state, row.error) == ("processed", "")
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.action, a.actor, a.target, a.detail) for a in recorded] == [
        ("webhook_event.reprocess", "admin:op", row, "processed -> processed")
    ] * 2  # each press, recorded


def test_reprocessing_applies_an_event_whose_processing_failed_once(
    staff: Client, smtp: SmtpServer
) -> None:
    event = paid_event(customer_email="late@example.com")
    row = stored(event, error="OperationalError('server closed the connection')")
    assert not Invoice.objects.exists()

    with worker_thread():
        response = run_action(staff, EVENTS, "reprocess_selected", [row.pk])
        smtp.handler.wait_for(1, timeout=20)
        again = run_action(staff, EVENTS, "reprocess_selected", [row.pk])
        pipeline_quiet()

    assert messages(response) == [
        ("success", "Reprocessed 1 webhook event(s): 1 processed, 0 ignored, 0 failed.")
    ]
    assert messages(again) == messages(response)
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.status) == (
        event["data"]["object"]["id"],
        "paid",
    )
    assert list(Job.objects.values_list("task", "args")) == [
        (send_invoice_email.module_path, [invoice.pk])
    ]
    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <late@example.com>"]
    assert EmailDelivery.objects.get().state == "sent"
    row.refresh_from_db()
    assert (row.state, row.error) == ("processed", "")


def test_reprocess_reports_failed_and_ignored_events(staff: Client) -> None:
    bad = paid_event(currency="us$")
    bad_row = stored(bad, state=WebhookEvent.State.PROCESSED)
    other = stored(
        stripe_events.event("customer.created", stripe_events.customer_object()),
        error="earlier failure",
    )

    response = run_action(staff, EVENTS, "reprocess_selected", [bad_row.pk, other.pk])

    assert messages(response) == [
        ("warning", "Reprocessed 2 webhook event(s): 0 processed, 1 ignored, 1 failed."),
        ("warning", f"Failed, the reason is on each event: {bad['id']}."),
    ]
    bad_row.refresh_from_db()
    other.refresh_from_db()
    assert (bad_row.state, bad_row.error) == (
        "failed",
        "data.object.currency is not a 3-letter code",
    )
    assert (other.state, other.error) == ("ignored", "")
    assert not Invoice.objects.exists()
    assert not Job.objects.exists()
    assert dict(OperatorAction.objects.values_list("target_id", "detail")) == {
        str(bad_row.pk): "processed -> failed: data.object.currency is not a 3-letter code",
        str(other.pk): "failed -> ignored",
    }


def test_a_viewer_sees_events_and_cannot_reprocess(client: Client) -> None:
    event = paid_event()
    post_event(client, stripe_events.encode(event))
    row = WebhookEvent.objects.get()
    viewer = admin_as(staff_user("watcher", groups=["viewers"]))

    assert [r["event_id"] for r in rows(viewer.get(EVENTS))] == [event["id"]]
    assert viewer.get(f"{EVENTS}{row.pk}/change/").status_code == 200
    assert action_choices(viewer.get(EVENTS)) == []
    assert messages(run_action(viewer, EVENTS, "reprocess_selected", [row.pk])) == []
    assert not OperatorAction.objects.exists()

    reprocessor = admin_as(
        staff_user(
            "reprocessor", perms=["webhooks.view_webhookevent", "webhooks.reprocess_webhookevent"]
        )
    )
    assert action_choices(reprocessor.get(EVENTS)) == ["reprocess_selected"]
    run_action(reprocessor, EVENTS, "reprocess_selected", [row.pk])
    recorded = OperatorAction.objects.get()
    assert (recorded.actor, recorded.target) == ("admin:reprocessor", row)
    page = viewer.get(f"{EVENTS}{row.pk}/change/").content.decode()
    assert "webhook_event.reprocess" in page  # on the event's page, for the viewer too


def test_an_event_whose_json_holds_lone_surrogates_is_shown(staff: Client) -> None:
    # Stored as signed (the escapes are ASCII); decoded, they are text no response can encode.
    event = paid_event(customer_name="Jen\ud800ny")
    event["data"]["object"]["lines"]["\udfff"] = "x"
    row = stored(event, body=json.dumps(event, indent=2).encode())

    response = staff.get(f"{EVENTS}{row.pk}/change/")

    assert response.status_code == 200
    page = response.content.decode()
    assert "Jen\\ud800ny" in page  # shown as the escape it was signed as
    assert "&quot;\\udfff&quot;: &quot;x&quot;" in page
