"""The email provider's circuit breaker end to end: a real worker, the real Redis breaker, and
an SMTP server that goes down and comes back.

During the outage the SMTP server is down (``stack.smtp.Faults.down``): it accepts each
connection and closes it at once, before its greeting (an MTA that is down behind its
address), so every connection attempt is counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import task_postrun

from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery, Invoice
from invoicing.services import SEND_INVOICE_EMAIL_TASK, email_breaker
from invoicing.tasks import send_invoice_email
from stack.net import wait_until
from stack.smtp import Faults, SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.mail import use_smtp
from tests.helpers.processes import worker_thread
from tests.helpers.quiescence import pipeline_quiet

pytestmark = pytest.mark.django_db(transaction=True)

THRESHOLD = 3
RESET = 2  # seconds of cool-down
CONCURRENCY = 4
EMAILS = 20


@pytest.fixture
def breaker_settings(settings: Any) -> Any:
    settings.EMAIL_BREAKER_FAILURE_THRESHOLD = THRESHOLD
    settings.EMAIL_BREAKER_RESET_SECONDS = RESET
    settings.EMAIL_PROVIDER_DEADLINE_SECONDS = 600
    return settings


@pytest.fixture
def finished_runs() -> Iterator[list[dict[str, Any]]]:
    """Every run of the email task that ended, with the retry count and deferrals it carried."""
    runs: list[dict[str, Any]] = []

    def record(sender: Any, task: Any, args: Any, state: str, **_: Any) -> None:
        if task.name == SEND_INVOICE_EMAIL_TASK:
            runs.append(
                {
                    "invoice_id": args[0],
                    "state": state,
                    "retries": task.request.retries,
                    "deferrals": int(getattr(task.request, "deferrals", 0) or 0),
                }
            )

    task_postrun.connect(record, weak=False)
    yield runs
    task_postrun.disconnect(record)


def paid_invoices(count: int) -> list[Invoice]:
    return [paid_invoice(f"in_outage_{n}", amount_paid=100 + n) for n in range(count)]


@pytest.mark.slow
def test_an_smtp_outage_sends_one_probe_per_cool_down_and_everything_after_recovery(
    breaker_settings: Any, finished_runs: list[dict[str, Any]]
) -> None:
    smtp = SmtpServer(faults=Faults(down=True)).start()
    use_smtp(breaker_settings, smtp.port)
    invoices = paid_invoices(EMAILS)
    breaker = email_breaker()
    try:
        with worker_thread(concurrency=CONCURRENCY):
            started = time.time()
            for invoice in invoices:
                send_invoice_email.delay(invoice.pk)

            # The breaker opens after THRESHOLD consecutive failures.
            assert wait_until(lambda: breaker.state()["state"] == "open", timeout=20)
            opened = breaker.state()
            assert opened["failures"] >= THRESHOLD
            first_opened_at = opened["opened_at"]

            time.sleep(4 * RESET)  # the outage lasts four cool-downs more

            smtp.handler.faults.down = False
            recovered = time.time()
            connections = list(smtp.handler.down_connections)
            smtp.handler.wait_for(EMAILS, timeout=30)
            drained = time.time()
            assert wait_until(
                lambda: sum(r["state"] == "SUCCESS" for r in finished_runs) >= EMAILS,
                timeout=10,
            )
            pipeline_quiet()
            messages = smtp.messages
    finally:
        smtp.stop()

    # Before the first cool-down ended, only the calls let in while it was closed connected.
    before_probes = [t for t in connections if t < first_opened_at + RESET]
    probes = [t for t in connections if t >= first_opened_at + RESET]
    outage = recovered - first_opened_at
    print(
        f"\n{EMAILS} emails queued; SMTP down {recovered - started:.1f} s; "
        f"{len(connections)} SMTP connections during the outage "
        f"({len(before_probes)} before it opened, {len(probes)} probes over {outage:.1f} s, "
        f"cool-down {RESET} s); all sent {drained - recovered:.1f} s after recovery"
    )
    assert THRESHOLD <= len(before_probes) <= THRESHOLD + CONCURRENCY - 1
    # About one probe per cool-down, not one connection per queued email (100 without it).
    assert 1 <= len(probes) <= outage / RESET + 1
    assert len(connections) < EMAILS

    # After recovery: every invoice emailed exactly once, nothing dead-lettered.
    assert sorted(m["To"] for m in messages) == sorted(i.customer_email for i in invoices)
    assert len({m["Message-ID"] for m in messages}) == EMAILS
    assert not DeadLetter.objects.exists()
    deliveries = EmailDelivery.objects.all()
    assert [d.state for d in deliveries] == ["sent"] * EMAILS
    # Deferred jobs claimed nothing: every claim was one SMTP connection.
    assert sum(d.attempts for d in deliveries) == EMAILS + len(connections)
    assert drained - recovered < 2 * RESET + 5
    assert breaker.state()["state"] == "closed"

    # No attempt was spent while deferred: only the failures before it opened were retries.
    successes = [r for r in finished_runs if r["state"] == "SUCCESS"]
    assert sorted(r["invoice_id"] for r in successes) == sorted(i.pk for i in invoices)
    assert sum(r["retries"] for r in successes) == len(before_probes)
    assert sum(r["deferrals"] for r in successes) >= EMAILS - len(before_probes)
    assert max(r["deferrals"] for r in successes) >= 2


def test_a_refused_recipient_is_the_provider_answering_and_does_not_open_it(
    breaker_settings: Any, smtp: SmtpServer
) -> None:
    smtp.handler.faults.always = "550 5.7.1 message rejected"
    invoices = paid_invoices(THRESHOLD + 2)
    with worker_thread():
        for invoice in invoices:
            send_invoice_email.delay(invoice.pk)
        assert wait_until(lambda: DeadLetter.objects.count() == len(invoices), timeout=20)
    state = email_breaker().state()
    assert (state["state"], state["failures"]) == ("closed", 0)
    assert smtp.handler.attempts == len(invoices)
    assert set(DeadLetter.objects.values_list("reason", flat=True)) == {"permanent"}


@pytest.mark.slow
def test_deferrals_of_single_messages_are_the_provider_answering_and_do_not_open_it(
    breaker_settings: Any, smtp: SmtpServer
) -> None:
    """A 451 defers this message: the server is up. Every send deferred, again and again,
    leaves the breaker closed; the messages are retried (and, here, sent once it accepts)."""
    smtp.handler.faults.always = "451 4.3.0 try again later"
    invoices = paid_invoices(THRESHOLD + 2)
    with worker_thread(concurrency=CONCURRENCY):
        for invoice in invoices:
            send_invoice_email.delay(invoice.pk)
        # Each invoice deferred twice: twice the threshold of failures in all, none counted.
        assert wait_until(lambda: smtp.handler.attempts >= 2 * len(invoices), timeout=30)
        state = email_breaker().state()
        smtp.handler.faults.always = None
        smtp.handler.wait_for(len(invoices), timeout=30)
    assert (state["state"], state["failures"]) == ("closed", 0)
    assert len(smtp.messages) == len(invoices)
    assert not DeadLetter.objects.exists()


@pytest.mark.slow
def test_past_the_deadline_a_deferred_email_is_dead_lettered_as_provider_unavailable(
    settings: Any, smtp_unreachable: int
) -> None:
    settings.EMAIL_BREAKER_FAILURE_THRESHOLD = 1
    settings.EMAIL_BREAKER_RESET_SECONDS = 1
    settings.EMAIL_PROVIDER_DEADLINE_SECONDS = 3
    invoices = paid_invoices(2)
    with worker_thread():
        for invoice in invoices:
            send_invoice_email.delay(invoice.pk)
        assert wait_until(lambda: DeadLetter.objects.count() == 2, timeout=30)
        pipeline_quiet()
    letters = list(DeadLetter.objects.order_by("args"))
    assert [letter.args for letter in letters] == [[i.pk] for i in invoices]
    for letter in letters:
        assert letter.reason == DeadLetter.Reason.PROVIDER_UNAVAILABLE == "provider_unavailable"
        assert letter.exception_class == "asyncwork.errors.ProviderUnavailable"
        assert "circuit open" in letter.exception_message
        # Deferred for the whole deadline, counted from the first deferral across many
        # re-publications, yet at most the one attempt made before the breaker opened.
        assert (letter.last_failed_at - letter.first_failed_at).total_seconds() >= 3
        assert letter.attempts <= 2
    assert not EmailDelivery.objects.filter(state="sending").exists()
