"""The ``invoice_email_sent`` key under real concurrency: threads racing the service, and
separate worker processes racing through the broker."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from asyncwork.errors import PermanentError
from asyncwork.models import Job, WorkerHeartbeat
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import (
    EmailInProgress,
    _claim_mark_sent,
    _claim_release,
    email_claim,
    invoice_email_key,
    invoice_email_message_id,
    invoice_email_send,
    send_invoice_email,
)
from stack import launch
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def test_ten_threads_racing_for_one_invoice_send_one_email(smtp: SmtpServer) -> None:
    invoice = paid_invoice()
    smtp.handler.faults.delay = 0.5  # keep the winner inside its SMTP conversation
    barrier = threading.Barrier(10)
    outcomes: list[str] = []

    def run(n: int) -> None:
        try:
            barrier.wait()
            outcomes.append(invoice_email_send(invoice_id=invoice.pk, owner=f"thread-{n}"))
        except EmailInProgress:  # the claim held by the winner: its job would wait for it
            outcomes.append("in progress")
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["in progress"] * 9 + ["sent"]
    assert len(smtp.messages) == 1
    assert invoice_email_send(invoice_id=invoice.pk, owner="later") == "skipped"
    assert len(smtp.messages) == 1


@pytest.mark.slow
def test_two_worker_processes_given_ten_jobs_for_one_invoice_send_one_email(
    smtp: SmtpServer,
) -> None:
    invoice = paid_invoice()
    smtp.handler.faults.delay = 0.3
    workers = [
        launch.celery_worker(worker_env(smtp.port), name=f"race{n}", concurrency=2)
        for n in range(2)
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        # Ten jobs, as ten payment events enqueueing at once would make: each reaches the key.
        for _ in range(10):
            send_invoice_email.enqueue(invoice.pk)
        smtp.handler.wait_for(1, timeout=30)
        # Let every job end before counting: those that found the claim held wait for it (a few
        # seconds, no attempt spent), then find the email sent.
        assert wait_until(lambda: Job.objects.filter(status="SUCCESSFUL").count() == 10, timeout=60)
    finally:
        for worker in workers:
            worker.stop()
    assert len(smtp.messages) == 1
    assert all(w.log_text().count(" succeeded in ") > 0 for w in workers)  # both took part
    assert EmailDelivery.objects.get().state == "sent"
    outcomes = Job.objects.values_list("status", "return_value", "attempts")
    assert sorted(outcomes) == [("SUCCESSFUL", "sent", 1)] + [("SUCCESSFUL", "skipped", 1)] * 9


def test_a_live_claim_blocks_and_an_expired_claim_is_taken_over(settings: Any) -> None:
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    first = email_claim(invoice_id=invoice.pk, key=key, owner="a").claim
    assert first is not None
    assert email_claim(invoice_id=invoice.pk, key=key, owner="b").claim is None  # live: blocked
    EmailDelivery.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    # The domain changes meanwhile: the key keeps the Message-ID it recorded first.
    settings.DEFAULT_FROM_EMAIL = "billing@elsewhere.example"
    second = email_claim(
        invoice_id=invoice.pk, key=key, owner="b"
    ).claim  # the owner died: taken over
    assert second is not None
    assert second.attempts == 2
    assert second.message_id == first.message_id  # a duplicate would carry the same id
    assert first.message_id == EmailDelivery.objects.get(key=key).message_id
    assert first.message_id.endswith("@example.com>")
    EmailDelivery.objects.filter(key=key).update(state="sent")
    EmailDelivery.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert email_claim(invoice_id=invoice.pk, key=key, owner="c").claim is None  # sent: never again


def beat(owner: str, *, ago: float = 0) -> None:
    """A heartbeat row for ``owner``, written ``ago`` seconds ago by the database's clock."""
    WorkerHeartbeat.objects.update_or_create(
        owner=owner,
        defaults={
            "hostname": "h",
            "pid": 1,
            "started_at": Now() - timedelta(minutes=1),
            "beat_at": Now() - timedelta(seconds=ago),
        },
    )


def claim_age(key: str, seconds: float) -> None:
    EmailDelivery.objects.filter(key=key).update(updated_at=Now() - timedelta(seconds=seconds))


def test_a_live_owner_is_never_overtaken_and_a_gone_one_is_at_once(settings: Any) -> None:
    """Ages by the database's clock (lapse 10 s here): a claim whose owner beats is held for
    its whole lease however old it is; once its owner's heartbeat lapsed it is taken over
    before its lease ends; an owner that never beat is given the lapse from its claim."""
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": 10}
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    beat("slow")
    beat("other")  # the process that would take it over beats too
    first = email_claim(invoice_id=invoice.pk, key=key, owner="slow").claim
    assert first is not None
    claim_age(key, 60)  # a slow send, well past the lapse: its owner still beats
    assert email_claim(invoice_id=invoice.pk, key=key, owner="other").claim is None
    beat("slow", ago=9)  # one late heartbeat short of the lapse
    beat("other")
    assert email_claim(invoice_id=invoice.pk, key=key, owner="other").claim is None
    beat("slow", ago=11)  # gone
    beat("other")
    second = email_claim(invoice_id=invoice.pk, key=key, owner="other").claim
    assert second is not None
    assert second.attempts == 2
    lease = EmailDelivery.objects.get(key=key).lease_expires_at
    assert lease is not None
    assert lease > timezone.now()  # taken over before its lease ended

    never = paid_invoice()
    never_key = invoice_email_key(never.pk)
    assert email_claim(invoice_id=never.pk, key=never_key, owner="no-heartbeat").claim is not None
    claim_age(never_key, 9)
    assert email_claim(invoice_id=never.pk, key=never_key, owner="other").claim is None
    claim_age(never_key, 11)
    beat("other")
    assert email_claim(invoice_id=never.pk, key=never_key, owner="other").claim is not None


def test_nobody_is_judged_gone_while_nobody_could_beat() -> None:
    """The database stalled, restarted or was cut off from every worker: no heartbeat was
    written for longer than the lapse, by anyone. Ages count back from the newest heartbeat,
    so no owner looks gone until the others have beaten without it for the whole lapse."""
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    beat("owner", ago=30)
    beat("other", ago=29)
    assert email_claim(invoice_id=invoice.pk, key=key, owner="owner").claim is not None
    claim_age(key, 31)
    assert email_claim(invoice_id=invoice.pk, key=key, owner="other").claim is None
    beat("other")  # the database is back; "owner" has not beaten since, for 30 s
    assert email_claim(invoice_id=invoice.pk, key=key, owner="other").claim is not None


def test_rescue_by_heartbeat_off_leaves_the_lease_alone_to_decide(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": 0}
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    assert email_claim(invoice_id=invoice.pk, key=key, owner="gone").claim is not None
    claim_age(key, 3600)
    assert email_claim(invoice_id=invoice.pk, key=key, owner="other").claim is None


def test_the_owner_of_a_claim_taken_over_writes_nothing() -> None:
    """The fence is the owner and the claim's token: after a takeover the old owner's release
    and mark sent match nothing, even where it is the same process claiming again (a retry):
    its claim (``Claim.update``) is not on the row any more."""
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    old = email_claim(invoice_id=invoice.pk, key=key, owner="zombie").claim
    assert old is not None
    claim_age(key, 60)
    beat("zombie", ago=60)
    beat("rescuer")
    new = email_claim(invoice_id=invoice.pk, key=key, owner="rescuer").claim
    assert new is not None
    before = EmailDelivery.objects.values().get(key=key)

    assert not EmailDelivery.objects.filter(
        pk=old.delivery_id, claimed_by=old.owner, attempts=old.attempts
    ).exists()
    _claim_release(old, error="late failure", recipient="late@example.com")
    assert not _claim_mark_sent(old, recipient="late@example.com", provider_message_id="late")
    assert EmailDelivery.objects.values().get(key=key) == before

    assert _claim_mark_sent(new, recipient="new@example.com", provider_message_id="")
    assert EmailDelivery.objects.get(key=key).state == EmailDelivery.State.SENT


def test_the_claim_reads_the_invoice_claims_only_a_paid_one_and_knows_a_missing_one() -> None:
    invoice = paid_invoice()
    key = invoice_email_key(invoice.pk)
    Invoice.objects.filter(pk=invoice.pk).update(status="open", customer_name="Read Back")
    read = email_claim(invoice_id=invoice.pk, key=key, owner="x")
    assert (read.invoice.pk, read.invoice.status, read.invoice.customer_name) == (
        invoice.pk,
        "open",
        "Read Back",
    )
    assert read.claim is None
    assert not EmailDelivery.objects.exists()  # an unpaid invoice's key is not even written

    Invoice.objects.filter(pk=invoice.pk).update(status="paid")
    read = email_claim(invoice_id=invoice.pk, key=key, owner="x")
    assert read.invoice.status == "paid"
    assert read.claim is not None
    row = EmailDelivery.objects.get()
    assert (row.key, row.state, row.claimed_by, row.attempts) == (key, "sending", "x", 1)
    assert row.message_id == read.claim.message_id

    missing = Invoice.objects.order_by("pk").last().pk + 1  # type: ignore[union-attr]
    with pytest.raises(PermanentError, match=f"invoice {missing} does not exist"):
        email_claim(invoice_id=missing, key=f"invoice_email_sent:{missing}", owner="x")
    assert EmailDelivery.objects.count() == 1


def test_unpaid_invoice_sends_nothing(smtp: SmtpServer) -> None:
    invoice = paid_invoice()
    Invoice.objects.filter(pk=invoice.pk).update(status="open")
    assert invoice_email_send(invoice_id=invoice.pk, owner="x") == "not_paid"
    assert smtp.messages == []
    assert not EmailDelivery.objects.exists()


@pytest.mark.parametrize(
    "provider_id",
    [
        "in_1Plain.id-0",
        "in_Ünïcödé/../x y<z>@w",
        "\u2603\u2603",  # nothing left: the stand-in
        "in_" + "x" * 100,  # cut at 64
        "in_\u212a\u0130\uff21\U0001d400_k",  # look like ASCII letters, are not
    ],
)
def test_the_message_id_recorded_by_the_claim_is_the_one_sent(
    smtp: SmtpServer, provider_id: str
) -> None:
    """``invoice_email_message_id`` builds it once, for the claim to record; the message
    carries the recorded one, whatever the provider id holds."""
    invoice = paid_invoice(provider_id, customer_email="jenny@example.com")
    assert invoice_email_send(invoice_id=invoice.pk, owner="x") == "sent"
    expected = invoice_email_message_id(invoice, invoice_email_key(invoice.pk))
    assert EmailDelivery.objects.get(invoice=invoice).message_id == expected
    # As the message carries it, a long one folded over two lines.
    assert ["".join(str(m["Message-ID"]).split()) for m in smtp.messages] == [expected]
