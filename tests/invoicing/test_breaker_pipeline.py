"""The email provider's circuit breaker end to end: a real worker, the real Redis breaker, and
an SMTP server that goes down and comes back.

During the outage the SMTP server is down (``stack.smtp.Faults.down``): it accepts each
connection and closes it at once, before its greeting (an MTA that is down behind its
address), so every connection attempt is counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from asyncwork.backend import job_ran
from asyncwork.models import DeadLetter, Job
from invoicing.models import EmailDelivery, Invoice
from invoicing.tasks import email_breaker, send_invoice_email
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
def outcomes() -> Iterator[list[str]]:
    """What each run of the email task that ended came to, as the runner tells it
    (``asyncwork.backend.job_ran``): successful, retry, deferred or failed."""
    seen: list[str] = []

    def record(task: str = "", outcome: str = "", **_: Any) -> None:
        if task == send_invoice_email.module_path:
            seen.append(outcome)

    job_ran.connect(record, weak=False, dispatch_uid="test_breaker_pipeline.outcomes")
    yield seen
    job_ran.disconnect(dispatch_uid="test_breaker_pipeline.outcomes")


class Deferrals(logging.Handler):
    """How often each job was deferred, from the runner's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_job: Counter[int] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "deferred", 0):
            self.by_job[record.__dict__["job_id"]] += 1


@pytest.fixture
def deferrals() -> Iterator[Counter[int]]:
    """On the runner's own logger: a worker starting in this process configures logging again,
    which replaces the root logger's handlers (pytest's caplog among them)."""
    handler = Deferrals()
    runner = logging.getLogger("asyncwork.runner")
    runner.addHandler(handler)
    yield handler.by_job
    runner.removeHandler(handler)


def paid_invoices(count: int) -> list[Invoice]:
    return [paid_invoice(f"in_outage_{n}", amount_paid=100 + n) for n in range(count)]


@pytest.mark.slow
def test_an_smtp_outage_sends_one_probe_per_cool_down_and_everything_after_recovery(
    breaker_settings: Any, outcomes: list[str], deferrals: Counter[int]
) -> None:
    smtp = SmtpServer(faults=Faults(down=True)).start()
    use_smtp(breaker_settings, smtp.port)
    invoices = paid_invoices(EMAILS)
    breaker = email_breaker()
    try:
        with worker_thread(concurrency=CONCURRENCY):
            started = time.time()
            for invoice in invoices:
                send_invoice_email.enqueue(invoice.pk)

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
            assert wait_until(lambda: outcomes.count("successful") >= EMAILS, timeout=10)
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
    jobs = list(Job.objects.all())
    assert sorted(job.args[0] for job in jobs) == sorted(i.pk for i in invoices)
    assert {job.status for job in jobs} == {"SUCCESSFUL"}
    assert outcomes.count("successful") == EMAILS
    assert outcomes.count("retry") == len(before_probes) == sum(len(job.errors) for job in jobs)
    assert sum(job.attempts for job in jobs) == EMAILS + len(before_probes)
    assert outcomes.count("deferred") == sum(deferrals.values()) >= EMAILS - len(before_probes)
    assert max(deferrals.values()) >= 2


def test_a_refused_recipient_is_the_provider_answering_and_does_not_open_it(
    breaker_settings: Any, smtp: SmtpServer
) -> None:
    smtp.handler.faults.always = "550 5.7.1 message rejected"
    invoices = paid_invoices(THRESHOLD + 2)
    with worker_thread():
        for invoice in invoices:
            send_invoice_email.enqueue(invoice.pk)
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
            send_invoice_email.enqueue(invoice.pk)
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
            send_invoice_email.enqueue(invoice.pk)
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
