"""The ``invoice_email_sent`` key under real concurrency: threads racing the service, and
separate worker processes racing through the broker."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from invoicing.models import EmailDelivery, Invoice
from invoicing.services import email_claim, invoice_email_key, invoice_email_send
from invoicing.tasks import send_invoice_email
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
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == ["sent"] + ["skipped"] * 9
    assert len(smtp.messages) == 1
    assert invoice_email_send(invoice_id=invoice.pk, owner="later") == "skipped"
    assert len(smtp.messages) == 1


def test_two_worker_processes_given_the_job_ten_times_send_one_email(smtp: SmtpServer) -> None:
    invoice = paid_invoice()
    smtp.handler.faults.delay = 0.3
    workers = [
        launch.celery_worker(worker_env(smtp.port), name=f"race{n}", concurrency=2)
        for n in range(2)
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        for _ in range(10):
            send_invoice_email.delay(invoice.pk)
        smtp.handler.wait_for(1, timeout=30)
        # Let every copy of the job run before counting.
        assert wait_until(
            lambda: sum(w.log_text().count(" succeeded in ") for w in workers) >= 10, timeout=30
        )
    finally:
        for worker in workers:
            worker.stop()
    assert len(smtp.messages) == 1
    assert all(w.log_text().count(" succeeded in ") > 0 for w in workers)  # both took part
    assert EmailDelivery.objects.get().state == "sent"


def test_a_live_claim_blocks_and_an_expired_claim_is_taken_over() -> None:
    invoice = paid_invoice()
    key = invoice_email_key(invoice)
    first = email_claim(invoice=invoice, key=key, owner="a")
    assert first is not None
    assert email_claim(invoice=invoice, key=key, owner="b") is None  # live: blocked
    EmailDelivery.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    second = email_claim(invoice=invoice, key=key, owner="b")  # the owner died: taken over
    assert second is not None
    assert second.attempts == 2
    assert second.message_id == first.message_id  # a duplicate would carry the same id
    EmailDelivery.objects.filter(key=key).update(state="sent")
    EmailDelivery.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert email_claim(invoice=invoice, key=key, owner="c") is None  # sent: never again


def test_unpaid_invoice_sends_nothing(smtp: SmtpServer) -> None:
    invoice = paid_invoice()
    Invoice.objects.filter(pk=invoice.pk).update(status="open")
    assert invoice_email_send(invoice_id=invoice.pk, owner="x") == "not_paid"
    time.sleep(0.2)
    assert smtp.messages == []
    assert not EmailDelivery.objects.exists()
