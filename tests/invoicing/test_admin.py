"""The invoices admin: the email's status at a glance, search, and a "Resend invoice email"
action that sends a deliberate new email under its own key and records who asked, after a
confirmation page that states the count and carries one key for the selection (submitted
twice, even at once, it sends once), for at most RESEND_SELECTION_MAX invoices. Every field
the provider gives is read-only; the recipient is corrected through its own permissioned form,
recorded with its before and after, and the provider's next event does not undo it."""

from __future__ import annotations

import html
import re
import threading
import time
import uuid
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.utils import timezone

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.models import IdempotencyRecord, Job
from invoicing.admin import RESEND_SELECTION_MAX
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import invoice_email_key, invoice_email_send, resend_invoice_email
from stack import stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.admin import (
    EMPTY,
    action_choices,
    admin_as,
    form_data,
    messages,
    rows,
    run_action,
)
from tests.helpers.database import lock_waiters
from tests.helpers.deadletters import refused_invoice_dead_letter
from tests.helpers.factories import staff_user
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import paid_event, post_event

pytestmark = pytest.mark.django_db(transaction=True)

INVOICES = "/admin/invoicing/invoice/"
DELIVERIES = "/admin/invoicing/emaildelivery/"


def correct(client: Client, invoice: Invoice, **data: str) -> Any:
    return client.post(f"{INVOICES}{invoice.pk}/correct-recipient/", data)


def invoice(number: str, *, status: str = "paid", **fields: Any) -> Invoice:
    return Invoice.objects.create(
        provider_invoice_id=f"in_{number.lower()}",
        number=number,
        customer_email=f"{number.lower()}@example.com",
        customer_name="Jenny Rosen",
        amount_paid=2000 if status == "paid" else 0,
        currency="usd",
        status=status,
        paid_at=timezone.now() if status == "paid" else None,
        provider_updated_at=timezone.now(),
        **fields,
    )


def confirmation(client: Client, pks: list[Any]) -> dict[str, list[str]]:
    """Choose "Resend invoice email" for ``pks``: what its confirmation page's form sends."""
    return form_data(run_action(client, INVOICES, "resend_email", pks), "resend-email-form")


def resend_confirmed(client: Client, pks: list[Any]) -> Any:
    """Choose "Resend invoice email" for ``pks`` and confirm: the page it comes back to."""
    return client.post(INVOICES, confirmation(client, pks), follow=True)


def test_list_search_filter_and_detail(staff: Client, smtp: SmtpServer) -> None:
    sent, pending, unpaid = invoice("INV-1"), invoice("INV-2"), invoice("INV-3", status="open")
    assert invoice_email_send(invoice_id=sent.pk, owner="test") == "sent"

    listed = {row["number"]: row for row in rows(staff.get(INVOICES))}
    assert listed["INV-1"]["customer_email"] == "inv-1@example.com"
    assert listed["INV-1"]["amount"] == "20.00 USD"
    assert (listed["INV-1"]["status"], listed["INV-1"]["email_status_display"]) == ("Paid", "sent")
    assert listed["INV-1"]["email_when"] != EMPTY
    assert (listed["INV-2"]["email_status_display"], listed["INV-2"]["email_when"]) == (
        "pending",
        EMPTY,
    )
    assert listed["INV-3"]["email_status_display"] == "none"
    for query in ("INV-2", "inv-2@example.com", "in_inv-2"):
        assert [r["number"] for r in rows(staff.get(INVOICES, {"q": query}))] == ["INV-2"]
    by_status = rows(staff.get(INVOICES, {"email_status": "sent"}))
    assert [r["number"] for r in by_status] == ["INV-1"]

    detail = staff.get(f"{INVOICES}{sent.pk}/change/")
    assert detail.status_code == 200
    assert invoice_email_key(sent.pk).encode() in detail.content  # the deliveries inline
    assert pending.pk != unpaid.pk


def test_resend_sends_a_new_email_under_its_own_key_and_records_who_asked(
    staff: Client, smtp: SmtpServer
) -> None:
    paid, unpaid = invoice("INV-10"), invoice("INV-11", status="open")
    assert invoice_email_send(invoice_id=paid.pk, owner="payment") == "sent"
    payment = EmailDelivery.objects.get(key=invoice_email_key(paid.pk))
    asked_at = timezone.now()

    with worker_thread():
        response = resend_confirmed(staff, [paid.pk, unpaid.pk])
        smtp.handler.wait_for(2, timeout=20)
        again = resend_confirmed(staff, [paid.pk])  # chosen again: a new confirmation, a new email
        smtp.handler.wait_for(3, timeout=20)
        pipeline_quiet()

    assert messages(response) == [
        ("success", "Requested 1 invoice email resend(s)."),
        ("warning", "Skipped 1 unpaid invoice(s): INV-11."),
    ]
    assert messages(again) == [("success", "Requested 1 invoice email resend(s).")]
    resends = list(EmailDelivery.objects.exclude(pk=payment.pk).order_by("pk"))
    assert len(resends) == 2  # each click is a deliberate new email
    for resend in resends:
        assert resend.key.startswith(f"invoice_email_resend:{paid.pk}:")
        assert resend.invoice_id == paid.pk
        assert resend.requested_by == "admin:op"
        assert resend.created_at >= asked_at
        assert resend.state == "sent"
    assert resends[0].key != resends[1].key
    assert list(
        Job.objects.filter(task=resend_invoice_email.module_path).values_list("args", flat=True)
    ) == [[r.pk] for r in resends]
    assert len(smtp.messages) == 3  # the payment email and the two resends
    assert len({m["Message-ID"] for m in smtp.messages}) == 3
    untouched = EmailDelivery.objects.get(pk=payment.pk)
    assert (untouched.state, untouched.attempts, untouched.sent_at, untouched.updated_at) == (
        payment.state,
        payment.attempts,
        payment.sent_at,
        payment.updated_at,
    )
    assert not unpaid.emails.exists()
    recorded = list(OperatorAction.objects.order_by("pk"))
    assert [(a.action, a.actor, a.target) for a in recorded] == [
        ("invoice.email_resend", "admin:op", paid)
    ] * 2  # one per click that asked for an email; the unpaid invoice was refused
    assert [a.detail for a in recorded] == [f"requested under {r.key}" for r in resends]

    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    for column in ("requested_by", "actor"):  # the deliveries, and the operator actions
        assert len(re.findall(rf'class="field-{column}">\s*<p>admin:op</p>', page)) == 2


def test_the_confirmation_states_the_count_and_a_double_submit_sends_once(
    staff: Client, smtp: SmtpServer
) -> None:
    paid = [invoice(f"INV-3{n}") for n in range(3)]
    unpaid = invoice("INV-39", status="open")
    pks = [i.pk for i in (*paid, unpaid)]

    page = run_action(staff, INVOICES, "resend_email", pks)

    assert page.status_code == 200
    assert page.templates[0].name == "admin/invoicing/invoice/resend_email_confirmation.html"
    assert "admin/base_site.html" in [t.name for t in page.templates]
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", page.content.decode())).split())
    assert "Resend the invoice email of 3 invoices?" in text
    assert "1 of the selected invoice is not paid and gets nothing: INV-39." in text
    assert "Yes, resend 3 emails" in page.content.decode()
    data = form_data(page, "resend-email-form")
    assert sorted(map(int, data["_selected_action"])) == sorted(pks)
    assert (data["action"], data["post"]) == (["resend_email"], ["yes"])
    assert uuid.UUID(data["idempotency_key"][0])
    # Nothing is sent, nor a key taken, until it is confirmed.
    assert not EmailDelivery.objects.exists()
    assert not IdempotencyRecord.objects.exists()

    with worker_thread():
        first = staff.post(INVOICES, data, follow=True)
        again = staff.post(INVOICES, data, follow=True)  # the same confirmation, resubmitted
        smtp.handler.wait_for(3, timeout=20)
        pipeline_quiet()

    assert messages(first) == [
        ("success", "Requested 3 invoice email resend(s)."),
        ("warning", "Skipped 1 unpaid invoice(s): INV-39."),
    ]
    assert messages(again) == [
        (
            "warning",
            "This confirmation was already submitted: its 3 invoice email resend(s) were "
            "requested then, and nothing was sent again.",
        )
    ]
    assert sorted(m["To"] for m in smtp.messages) == [
        f"Jenny Rosen <inv-3{n}@example.com>" for n in range(3)
    ]
    assert EmailDelivery.objects.count() == 3
    assert Job.objects.filter(task=resend_invoice_email.module_path).count() == 3
    [record] = IdempotencyRecord.objects.all()  # the API's store, under the operator
    assert (record.user.get_username(), record.key) == ("op", data["idempotency_key"][0])
    assert OperatorAction.objects.filter(actor="admin:op").count() == 3


def test_one_confirmation_submitted_twice_at_once_sends_once(
    staff: Client, smtp: SmtpServer
) -> None:
    """Two threads post the same confirmation at once, as a double click does. The first is
    held in its transaction (a lock on the job table) until the second waits on PostgreSQL
    for the selection's key: they overlap, and each invoice's email is sent once."""
    paid = [invoice("INV-40"), invoice("INV-41")]
    data = confirmation(staff, [i.pk for i in paid])
    user = get_user_model().objects.get(username="op")
    pages: list[Any] = []

    def submit() -> None:
        try:
            pages.append(admin_as(user).post(INVOICES, data, follow=True))
        finally:
            connections.close_all()

    holder = connections.create_connection("default")
    threads = [threading.Thread(target=submit) for _ in range(2)]
    with worker_thread():
        try:
            with holder.cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute(f"LOCK TABLE {Job._meta.db_table} IN SHARE MODE")
                for thread in threads:
                    thread.start()
                assert wait_until(lambda: lock_waiters() == 2, timeout=20)
                cursor.execute("COMMIT")
            for thread in threads:
                thread.join(30)
        finally:
            holder.close()
        smtp.handler.wait_for(2, timeout=20)
        pipeline_quiet()

    assert sorted(messages(page)[0][0] for page in pages) == ["success", "warning"]
    assert sorted(m["To"] for m in smtp.messages) == [
        "Jenny Rosen <inv-40@example.com>",
        "Jenny Rosen <inv-41@example.com>",
    ]
    assert EmailDelivery.objects.count() == 2
    assert Job.objects.filter(task=resend_invoice_email.module_path).count() == 2
    assert IdempotencyRecord.objects.count() == 1
    assert OperatorAction.objects.count() == 2


def test_more_than_the_bound_is_refused_with_a_pointer_and_sends_nothing(staff: Client) -> None:
    many = [invoice(f"INV-B{n}").pk for n in range(RESEND_SELECTION_MAX + 1)]

    at_bound = run_action(staff, INVOICES, "resend_email", many[:RESEND_SELECTION_MAX])
    assert f"Resend the invoice email of <strong>{RESEND_SELECTION_MAX} invoices" in (
        at_bound.content.decode()
    )
    refused = run_action(staff, INVOICES, "resend_email", many)
    # Back on the list, with the reason and where to go instead.
    assert refused.templates[0].name == "admin/change_list.html"
    [(level, text)] = messages(refused)
    assert level == "error"
    assert text.startswith(f"{RESEND_SELECTION_MAX + 1} invoices selected: at most ")
    assert "POST /api/invoices/<id>/resend-email/ with an Idempotency-Key" in text
    # A confirmation made up for more is refused the same way.
    forged = {**form_data(at_bound, "resend-email-form"), "_selected_action": many}
    assert messages(staff.post(INVOICES, forged, follow=True))[0][0] == "error"
    assert not EmailDelivery.objects.exists()
    assert not IdempotencyRecord.objects.exists()


def test_a_confirmation_for_another_selection_or_without_a_key_sends_nothing(
    staff: Client,
) -> None:
    a, b = invoice("INV-50"), invoice("INV-51")
    data = confirmation(staff, [a.pk])
    assert messages(staff.post(INVOICES, data, follow=True))[0][0] == "success"
    other = {**data, "_selected_action": [b.pk]}
    assert messages(staff.post(INVOICES, other, follow=True)) == [
        (
            "error",
            "This confirmation was made for another selection, and nothing was sent: choose "
            "the action again.",
        )
    ]
    for key in ("", "not-a-uuid"):
        keyless = {**data, "idempotency_key": [key]}
        assert messages(staff.post(INVOICES, keyless, follow=True))[0] == (
            "error",
            "This confirmation carries no valid key, and nothing was sent: choose the action "
            "again.",
        )
    assert list(EmailDelivery.objects.values_list("invoice_id", flat=True)) == [a.pk]


def test_a_viewer_sees_invoices_and_no_action_nor_correction(
    viewer: Client, smtp: SmtpServer
) -> None:
    paid = invoice("INV-20")

    assert [row["number"] for row in rows(viewer.get(INVOICES))] == ["INV-20"]
    assert action_choices(viewer.get(INVOICES)) == []
    page = viewer.get(f"{INVOICES}{paid.pk}/change/")
    assert page.status_code == 200
    assert b"Correct recipient" not in page.content
    assert viewer.get(f"{INVOICES}{paid.pk}/correct-recipient/").status_code == 403
    refused = correct(viewer, paid, email="evil@example.com", reason="because")
    assert refused.status_code == 403
    assert messages(run_action(viewer, INVOICES, "resend_email", [paid.pk])) == []
    confirmed = {
        "action": "resend_email",
        "_selected_action": [paid.pk],
        "post": "yes",
        "idempotency_key": str(uuid.uuid4()),
    }
    assert b"resend-email-form" not in viewer.post(INVOICES, confirmed, follow=True).content

    paid.refresh_from_db()
    assert paid.recipient_override == ""
    assert not EmailDelivery.objects.exists()
    assert not OperatorAction.objects.exists()


def test_each_invoice_power_opens_its_own_door_only(smtp: SmtpServer) -> None:
    paid = invoice("INV-21")
    view = "invoicing.view_invoice"
    resender = admin_as(staff_user("resender", perms=[view, "invoicing.resend_invoice_email"]))
    corrector = admin_as(
        staff_user("corrector", perms=[view, "invoicing.correct_invoice_recipient"])
    )
    assert action_choices(resender.get(INVOICES)) == ["resend_email"]
    assert b"Correct recipient" not in resender.get(f"{INVOICES}{paid.pk}/change/").content
    assert resender.get(f"{INVOICES}{paid.pk}/correct-recipient/").status_code == 403
    assert action_choices(corrector.get(INVOICES)) == []
    assert b"Correct recipient" in corrector.get(f"{INVOICES}{paid.pk}/change/").content
    assert corrector.get(f"{INVOICES}{paid.pk}/correct-recipient/").status_code == 200
    # The power without the view permission opens nothing.
    blind = admin_as(staff_user("blind", perms=["invoicing.correct_invoice_recipient"]))
    assert blind.get(f"{INVOICES}{paid.pk}/correct-recipient/").status_code == 403


def test_every_provider_field_is_read_only_even_for_a_superuser() -> None:
    paid = invoice("INV-30")
    before = Invoice.objects.filter(pk=paid.pk).values().get()
    root = admin_as(
        get_user_model().objects.create_superuser("root", "root@example.com", "pw-12345-long")
    )

    page = root.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    assert "View invoice" in page
    for field in (
        "number",
        "customer_email",
        "customer_name",
        "amount",
        "currency",
        "status",
        "hosted_invoice_url",
        "paid_at",
        "recipient_override",
    ):
        assert f'name="{field}"' not in page, field
        assert f"field-{field}" in page, field  # shown, as text
    assert 'name="_save"' not in page
    # The amount as money, not the provider's minor units.
    assert re.search(r'field-amount\b.*?<div class="readonly">20\.00 USD</div>', page, re.S)
    assert "field-amount_paid" not in page
    edited = root.post(
        f"{INVOICES}{paid.pk}/change/",
        {"customer_email": "evil@example.com", "status": "void", "amount_paid": "1"},
    )
    assert edited.status_code == 403
    assert root.get(f"{INVOICES}add/").status_code == 403
    assert root.post(f"{INVOICES}{paid.pk}/delete/").status_code == 403
    assert Invoice.objects.filter(pk=paid.pk).values().get() == before


def test_a_correction_is_validated_recorded_and_shown(staff: Client) -> None:
    paid = invoice("INV-40")
    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    form_url = f"{INVOICES}{paid.pk}/correct-recipient/"
    assert f'href="{form_url}"' in page
    form = staff.get(form_url)
    assert form.status_code == 200
    assert b"inv-40@example.com" in form.content  # the provider's address, for reference

    for data, error in (
        ({"email": "not an address", "reason": "typo"}, "Enter a valid email address."),
        ({"email": "a@example.com\nBcc: x@example.com", "reason": "x"}, "valid email"),
        ({"email": "right@example.com", "reason": "  "}, "This field is required."),
        ({"email": "", "reason": "undo"}, "there is no correction to remove"),
    ):
        refused = correct(staff, paid, **data)
        assert refused.status_code == 200, data
        assert error in refused.content.decode(), data
    paid.refresh_from_db()
    assert paid.recipient_override == ""
    assert not OperatorAction.objects.exists()

    done = correct(staff, paid, email=" right@example.com ", reason="customer called, #4411")
    assert done.status_code == 302
    assert done["Location"] == f"{INVOICES}{paid.pk}/change/"
    shown = staff.get(done["Location"])
    assert messages(shown)[0][0] == "success"
    assert "emails now go to right@example.com" in messages(shown)[0][1]
    paid.refresh_from_db()
    assert (paid.customer_email, paid.recipient_override, paid.recipient) == (
        "inv-40@example.com",
        "right@example.com",
        "right@example.com",
    )
    recorded = OperatorAction.objects.get()
    assert (recorded.action, recorded.actor, recorded.target, recorded.detail) == (
        "invoice.recipient_correct",
        "admin:op",
        paid,
        "customer called, #4411",
    )
    assert recorded.before == {"recipient_override": "", "recipient": "inv-40@example.com"}
    assert recorded.after == {
        "recipient_override": "right@example.com",
        "recipient": "right@example.com",
    }
    same = correct(staff, paid, email="right@example.com", reason="again")
    assert "the recipient is already right@example.com" in same.content.decode()
    assert OperatorAction.objects.count() == 1

    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    assert "invoice.recipient_correct" in page  # the operator actions, on the invoice
    assert "customer called, #4411" in page
    listed = rows(staff.get(INVOICES))[0]
    assert (listed["customer_email"], listed["recipient_override"]) == (
        "inv-40@example.com",
        "right@example.com",
    )
    assert [r["number"] for r in rows(staff.get(INVOICES, {"q": "right@example"}))] == ["INV-40"]


def test_the_providers_next_event_does_not_undo_a_correction_and_the_email_uses_it(
    client: Client, staff: Client, smtp: SmtpServer
) -> None:
    """The provider keeps sending its address; the operator's correction stands beside it,
    and the email goes where the operator said, until the correction is removed."""
    now = int(time.time())
    first = paid_event("in_corr", created=now - 60, customer_email="typo@exmaple.com")
    assert post_event(client, stripe_events.encode(first)).status_code == 200
    paid = Invoice.objects.get(provider_invoice_id="in_corr")
    assert correct(staff, paid, email="right@example.com", reason="typo").status_code == 302

    later = paid_event(
        "in_corr",
        created=now,
        event_type="invoice.payment_succeeded",
        customer_email="new@provider.com",
    )
    assert post_event(client, stripe_events.encode(later)).status_code == 200
    paid.refresh_from_db()
    assert (paid.customer_email, paid.recipient_override) == (
        "new@provider.com",
        "right@example.com",
    )
    assert invoice_email_send(invoice_id=paid.pk, owner="test") == "sent"
    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <right@example.com>"]

    removed = correct(staff, paid, email="", reason="the provider has it right now")
    assert removed.status_code == 302
    paid.refresh_from_db()
    assert paid.recipient == "new@provider.com"
    undone = OperatorAction.objects.order_by("pk").last()
    assert undone is not None
    assert undone.before == {
        "recipient_override": "right@example.com",
        "recipient": "right@example.com",
    }
    assert undone.after == {"recipient_override": "", "recipient": "new@provider.com"}


# --- Its emails, its dead letters, and the short path from a refusal to the email --------------

REFUSAL = "recipient refused: 550 5.1.1 mailbox unavailable (typo@exmaple.com)"


def inline_rows(page: str) -> list[dict[str, str]]:
    """The email deliveries inline of an invoice page: ``{column: text}`` per delivery."""
    section = page[page.index('id="emails-group"') :]
    section = section[: section.index("</fieldset>")]
    return [
        {
            name: " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
            for name, text in re.findall(r'<td class="field-(\w+)">(.*?)</td>', row, re.DOTALL)
        }
        for row in re.findall(r'<tr class="form-row[^"]*"[^>]*>(.*?)</tr>', section, re.DOTALL)
    ]


def href(page: str, pattern: str) -> str:
    """The one link on the page whose address matches ``pattern``."""
    links = {html.unescape(h) for h in re.findall(r'href="([^"]+)"', page)}
    [found] = [link for link in links if re.search(pattern, link)]
    return found


def test_the_invoice_page_shows_its_emails_and_links_its_dead_letters(
    client: Client, staff: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        paid, letter = refused_invoice_dead_letter(client, smtp)
    delivery = EmailDelivery.objects.get()

    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()

    [shown] = inline_rows(page)
    assert shown["state"] == "Failed"
    assert shown["recipient"] == paid.recipient
    assert shown["attempts"] == "1"
    assert shown["last_error"] == REFUSAL
    assert shown["message_id_display"] == delivery.message_id
    assert shown["sent_at"] == EMPTY
    for name, label in (
        ("state", "State"),
        ("attempts", "Attempts"),
        ("last_error", "Last error"),
        ("message_id_display", "Message-ID"),
        ("sent_at", "Sent at"),
    ):
        assert re.search(rf'<th class="column-{name}[^"]*">\s*{label}', page), label
    dead_letters = page[page.index('class="dead-letters"') :]
    assert f"Dead letter {letter.pk}</a>: waiting" in dead_letters
    assert REFUSAL in dead_letters
    listed = rows(staff.get(href(page, r"deadletter/\?id__in=")))
    assert [row["id"] for row in listed] == [str(letter.pk)]

    # Its address is unchanged: replayed only by force (it would fail again).
    call_command("dlq", "replay", str(letter.pk), "--force", stdout=StringIO())
    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    assert f"Dead letter {letter.pk}</a>: replayed by cli:" in page


def test_an_invoice_with_no_dead_letter_says_none(staff: Client) -> None:
    paid = invoice("INV-50")
    page = staff.get(f"{INVOICES}{paid.pk}/change/").content.decode()
    section = page[page.index("field-dead_letters") :]
    assert re.search(r'<div class="readonly">none</div>', section[:500])


def test_the_short_path_correct_the_recipient_then_replay_its_dead_letter(
    client: Client, staff: Client, smtp: SmtpServer
) -> None:
    """The path the README documents, followed link by link as an operator clicks it:
    invoice page -> Correct recipient -> the dead letter -> Replay."""
    with worker_thread():
        paid, letter = refused_invoice_dead_letter(client, smtp)
        invoice_page = f"{INVOICES}{paid.pk}/change/"

        page = staff.get(invoice_page).content.decode()
        form = href(page, r"/correct-recipient/$")
        corrected = staff.post(
            form, {"email": "fixed@example.com", "reason": "typo, ticket 7"}, follow=True
        )
        assert corrected.redirect_chain == [(invoice_page, 302)]
        assert "emails now go to fixed@example.com" in messages(corrected)[0][1]

        letter_page = href(corrected.content.decode(), rf"/deadletter/{letter.pk}/change/$")
        page = staff.get(letter_page).content.decode()
        assert "fixed@example.com" in page  # the recipient the replay will use
        [replay] = re.findall(r'<form method="post" action="([^"]+)" id="replay-form"', page)
        replayed = staff.post(replay, follow=True)
        assert messages(replayed) == [
            ("success", f"Replayed dead letter {letter.pk}: its job is queued again.")
        ]
        smtp.handler.wait_for(1, timeout=20)
        assert wait_until(lambda: EmailDelivery.objects.filter(state="sent").exists(), timeout=10)

    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <fixed@example.com>"]
    [shown] = inline_rows(staff.get(invoice_page).content.decode())
    assert (shown["state"], shown["attempts"], shown["last_error"]) == ("Sent", "2", EMPTY)
    assert shown["sent_at"] != EMPTY
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.action, a.actor, a.target) for a in recorded] == [
        ("invoice.recipient_correct", "admin:op", paid),
        ("dead_letter.replay", "admin:op", letter),
    ]


def test_email_deliveries_are_listed_read_only(viewer: Client, smtp: SmtpServer) -> None:
    sent, waiting = invoice("INV-60"), invoice("INV-61")
    assert invoice_email_send(invoice_id=sent.pk, owner="test") == "sent"
    EmailDelivery.objects.create(
        key=f"invoice_email_sent:{waiting.pk}", invoice=waiting, state="failed", attempts=2
    )
    listed = {row["key"]: row for row in rows(viewer.get(DELIVERIES))}
    assert listed[f"invoice_email_sent:{sent.pk}"]["state"] == "Sent"
    assert listed[f"invoice_email_sent:{sent.pk}"]["invoice_link"] == "INV-60"
    assert [row["key"] for row in rows(viewer.get(DELIVERIES, {"state": "failed"}))] == [
        f"invoice_email_sent:{waiting.pk}"
    ]
    delivery = EmailDelivery.objects.get(invoice=sent)
    detail = viewer.get(f"{DELIVERIES}{delivery.pk}/change/")
    assert detail.status_code == 200
    assert b'name="_save"' not in detail.content
    assert viewer.get(f"{DELIVERIES}add/").status_code == 403
    assert viewer.post(f"{DELIVERIES}{delivery.pk}/delete/").status_code == 403
