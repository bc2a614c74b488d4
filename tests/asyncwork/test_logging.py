"""Log lines carry event_id, invoice_id, task_id and attempt (asyncwork.logging), in the formats
settings.LOGGING configures: checked on lines the real pipeline writes, in this process and in
a real worker process running with LOG_FORMAT=json."""

from __future__ import annotations

import copy
import io
import json
import logging
import logging.config
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from asyncwork.backend import message_id
from asyncwork.contrib.logging import pii_mask
from asyncwork.logging import log_context, log_context_bind
from asyncwork.models import Job
from invoicing.models import EmailDelivery, Invoice
from stack import launch, stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests.helpers.processes import worker_env
from tests.helpers.stripe import paid_event, post_event


def console_handler(log_format: str, stream: io.StringIO) -> logging.Handler:
    """The console handler as settings.LOGGING builds it (its formatter and filters, resolved
    by logging's own dictConfig machinery), writing to ``stream``."""
    config = logging.config.DictConfigurator(copy.deepcopy(settings.LOGGING))
    spec = config.config["handlers"]["console"]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(config.configure_formatter(config.config["formatters"][log_format]))
    for name in spec["filters"]:
        handler.addFilter(config.configure_filter(config.config["filters"][name]))
    return handler


@pytest.fixture
def captured() -> Iterator[Any]:
    """Lines the root logger writes through a JSON console handler, as parsed objects."""
    stream = io.StringIO()
    handler = console_handler("json", stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_text_lines_append_the_fields_present_and_only_those() -> None:
    stream = io.StringIO()
    handler = console_handler("text", stream)
    logger = logging.getLogger("tests.logging.text")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("outside")
        log_context_bind(invoice_id=99)  # no context open: nothing to bind to
        logger.info("still outside")
        with log_context(event_id="evt_text"):
            log_context_bind(invoice_id=12)
            logger.info("inside")
            logger.info("explicit", extra={"invoice_id": 13})
            with log_context(event_id="evt_nested"):
                logger.info("nested")
            logger.info("back")
        logger.info("after")
    finally:
        logger.removeHandler(handler)

    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(" outside")
    assert lines[1].endswith(" still outside")
    assert lines[2].endswith(" inside event_id=evt_text invoice_id=12")
    assert lines[3].endswith(" explicit event_id=evt_text invoice_id=13")  # the call's own wins
    assert lines[4].endswith(" nested event_id=evt_nested invoice_id=12")
    assert lines[5].endswith(" back event_id=evt_text invoice_id=12")
    assert lines[6].endswith(" after")


@pytest.mark.django_db
def test_a_stale_event_line_carries_the_event_and_invoice_it_belongs_to(
    client: Client, captured: Any
) -> None:
    """The service logs a stale event with the invoice id only; the event id comes from the
    context the view opened, and leaves with the request."""
    invoice_id = stripe_events.new_id("in")
    newer = paid_event(invoice_id, created=1_900_000_000)
    older = paid_event(invoice_id, event_type="invoice.payment_succeeded", created=1_800_000_000)
    assert post_event(client, stripe_events.encode(newer)).status_code == 200
    assert post_event(client, stripe_events.encode(older)).status_code == 200
    logging.getLogger("tests.logging").info("after the requests")

    invoice = Invoice.objects.get(provider_invoice_id=invoice_id)
    records = captured()
    [stale] = [r for r in records if r["message"] == "stale invoice event ignored"]
    assert stale["event_id"] == older["id"]
    assert stale["invoice_id"] == invoice.pk
    assert stale["levelname"] == "INFO"
    [applied] = [
        r
        for r in records
        if r["message"] == "payment event applied" and r["event_id"] == newer["id"]
    ]
    assert applied["invoice_id"] == invoice.pk
    [after] = [r for r in records if r["message"] == "after the requests"]
    assert "event_id" not in after
    assert "invoice_id" not in after


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_json_lines_of_a_worker_process_carry_event_invoice_task_and_attempt(
    client: Client, smtp: SmtpServer
) -> None:
    """Webhook here, email job in a real worker process logging JSON: every line the job
    writes names the event, the invoice, the task and the attempt, across a retry."""
    smtp.handler.faults.replies = ["451 4.3.0 try again later"]  # attempt 1 fails, 2 sends
    worker = launch.celery_worker(worker_env(smtp.port, LOG_FORMAT="json"), name="json-logs")
    try:
        worker.wait_ready()
        event = paid_event()
        assert post_event(client, stripe_events.encode(event)).status_code == 200
        smtp.handler.wait_for(1, timeout=30)
        assert wait_until(lambda: "succeeded in" in worker.log_text(), timeout=10)
    finally:
        worker.stop()

    invoice = Invoice.objects.get()
    # One job, run twice: its retry is the same row made due again, under the same message id.
    job = Job.objects.get()
    task_id = message_id(job.pk)
    assert (job.status, job.attempts) == (Job.Status.SUCCESSFUL, 2)
    assert EmailDelivery.objects.get().attempts == 2
    records = [json.loads(line) for line in worker.log_text().splitlines() if line.startswith("{")]
    job_lines = [r for r in records if r.get("task_id") == task_id]

    [sent] = [r for r in job_lines if r["message"] == "invoice email sent"]
    assert (sent["event_id"], sent["invoice_id"], sent["attempt"]) == (event["id"], invoice.pk, 2)
    # The runner's line about the retry, which passes none of these fields: the filter and the
    # context add them.
    [retry] = [r for r in job_lines if r["message"].startswith("job failed (attempt 1 of ")]
    assert (retry["event_id"], retry["invoice_id"], retry["attempt"]) == (
        event["id"],
        invoice.pk,
        1,
    )
    # Celery's own line about each run, which passes none of these fields either.
    succeeded = [r for r in job_lines if "succeeded in" in r["message"]]
    assert [(r.get("event_id"), r.get("attempt")) for r in succeeded] == [
        (event["id"], 1),
        (event["id"], 2),
    ]
    # Every line of the job, both attempts, names the event, the invoice and the attempt.
    assert len(job_lines) >= 4
    assert all(r.get("event_id") == event["id"] for r in job_lines)
    assert all(r.get("invoice_id") == invoice.pk for r in job_lines)
    assert {r.get("attempt") for r in job_lines} == {1, 2}


def test_pii_mask_keeps_the_domain_and_valid_json() -> None:
    assert pii_mask("to jenny.rosen@example.com now") == "to j***@example.com now"
    assert pii_mask("<a@b.co>, {'x.y@z.example.org': (550, b'5.1.1')}") == (
        "<a***@b.co>, {'x***@z.example.org': (550, b'5.1.1')}"
    )
    assert pii_mask("no address @ all, user@localhost") == "no address @ all, user@localhost"
    # JSON escapes of a non-ASCII address stay valid JSON once masked.
    line = json.dumps({"message": 'refused "\u00e9lise@ex\u00e4mple.com"'})
    assert json.loads(pii_mask(line)) == {"message": 'refused "***@ex\u00e4mple.com"'}
    assert pii_mask("jenny@example.com, mailto:x+tag@mail.example.co.uk (a@b@c.io).") == (
        "j***@example.com, mailto:x***@mail.example.co.uk (a@b***@c.io)."
    )


# The address in each of its other forms: quoted local parts (RFC 5321), and the at-sign
# percent-encoded in a URL, or twice in a URL carried in a query string (the admin login's
# ?next= after a search).
OTHER_FORMS = {
    'to "jenny rosen"@example.com': "to j***@example.com",
    '<"a@b"@example.com>': "<a***@example.com>",
    "GET /search/jenny.rosen%40example.com": "GET /search/j***%40example.com",
    "/admin/?q=Jenny.Rosen%40Example.COM&o=1": "/admin/?q=J***%40Example.COM&o=1",
    "/admin/login/?next=/admin/invoicing/invoice/%3Fq%3Djenny.rosen%2540example.com": (
        "/admin/login/?next=/admin/invoicing/invoice/***%2540example.com"
    ),
}


@pytest.mark.parametrize(("text", "masked"), OTHER_FORMS.items(), ids=list(OTHER_FORMS))
def test_pii_mask_covers_quoted_local_parts_and_encoded_at_signs(text: str, masked: str) -> None:
    assert pii_mask(text) == masked
    # As the JSON formatter writes it (quotes escaped): masked too, and still valid JSON.
    line = pii_mask(json.dumps({"message": text, "extra": text}))
    assert json.loads(line) == {"message": masked, "extra": masked}


# Lines a client can have the web process log (a path, a Host header), built so that a mask
# which retries a run from each of its characters costs the square of its length: runs that end
# in an at-sign, at-signs and dots packed. 32 KB each.
HOSTILE = {
    "a run ending in @": "a" * 32767 + "@",
    "dotted run ending in @": "a." * 16383 + "@",
    "@.": "@." * 16384,
    ".@a": ".@a" * 10922,
    "a@a..": "a@a.." * 6553,
    "%40.": "%40." * 8192,
    '"a run"@': '"' + "a" * 32766 + '"@',
}
# The same with a space every 100 characters, where a record's message may be cut (each keeps
# the 8 KiB a record holds at most, all of it hostile).
HOSTILE |= {
    f"{name}, spaced": " ".join(re.findall(".{1,99}", text)) for name, text in HOSTILE.items()
}


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("message", HOSTILE.values(), ids=list(HOSTILE))
def test_masking_a_32_kb_hostile_line_takes_under_5_ms(log_format: str, message: str) -> None:
    formatter = console_handler(log_format, io.StringIO()).formatter
    assert formatter is not None
    record = logging.makeLogRecord(
        {"name": "django.request", "levelno": logging.WARNING, "levelname": "WARNING"}
    )
    record.msg = message

    def cpu_seconds() -> float:
        started = time.thread_time()
        formatter.format(record)
        return time.thread_time() - started

    # This thread's CPU time, the best of five: what the formatter costs, not what the
    # machine's other work does to a wall clock.
    assert min(cpu_seconds() for _ in range(5)) < 0.005


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_long_message_and_traceback_keep_their_ends_and_no_part_of_an_address(
    log_format: str,
) -> None:
    """Over 8 KiB, a message keeps its first and last 4 KiB, cut at whitespace: an address
    across a cut is left out whole, not left in part (too short to be masked); the line says
    how much was left out. The traceback likewise; JSON stays JSON."""
    stream = io.StringIO()
    handler = console_handler(log_format, stream)
    assert handler.formatter is not None
    # An address across each cut (4,096 characters from either end), others near the ends.
    filler = "lorem ipsum " * 2000
    message = (
        "first jenny.rosen@example.com "
        + "x" * 4070
        + " straddling.head@example.com "
        + filler
        + " straddling.tail@example.com "
        + "y" * 4070
        + " last john.doe@example.org"
    )
    try:
        raise ValueError("failed for " + filler + " mary@example.net")
    except ValueError:
        record = logging.LogRecord(
            "invoicing.mail", logging.ERROR, __file__, 1, "%s", (message,), sys.exc_info()
        )
    handler.handle(record)
    line = stream.getvalue()
    text = json.dumps(json.loads(line)) if log_format == "json" else line
    assert "j***@example.com" in text
    assert "j***@example.org" in text
    assert "m***@example.net" in text  # the end of the traceback, where its message is
    assert "straddling" not in text
    assert "characters left out ...]" in text
    assert "Traceback (most recent call last)" in text
    assert len(line) < 3 * 8192
    # The record itself is left as it came, for any other handler.
    assert record.getMessage() == message


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_line_holds_no_control_character_whatever_its_message_and_traceback(
    log_format: str,
) -> None:
    """A provider's words in a message, an exception's in a traceback: ESC, BEL, a one-byte CSI
    (C1) and a line break are escaped, so the line neither drives the terminal nor forges the
    next line; a traceback's lines are escaped each."""
    stream = io.StringIO()
    handler = console_handler(log_format, stream)
    hostile = "HTTP 400, \x1b]0;pwned\x07\x9b2J\r\n2026-12-06 ERROR forged"
    try:
        raise RuntimeError(hostile)
    except RuntimeError:
        record = logging.LogRecord(
            "webhooks.reconcile", logging.ERROR, __file__, 1, "stopped: %s", (hostile,), None
        )
        record.exc_info = sys.exc_info()
    handler.handle(record)
    text = stream.getvalue()
    controls = {c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F}
    assert not controls
    first, *trace = text.splitlines()
    if log_format == "json":  # escaped on the wire, the text itself to a reader
        assert json.loads(text)["message"] == f"stopped: {hostile}"
        return
    escaped = "\\x1b]0;pwned\\x07\\x9b2J\\r\\n2026-12-06 ERROR forged"
    assert first.endswith(f" 'stopped: HTTP 400, {escaped}'")
    assert trace[0] == "Traceback (most recent call last):"
    # A traceback's lines are its own: each is escaped, as Python breaks the message.
    assert "'RuntimeError: HTTP 400, \\x1b]0;pwned\\x07\\x9b2J\\r'" in trace


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("log_format", "log_pii"), [("text", "0"), ("json", "0"), ("text", "1")])
def test_a_refused_recipient_never_reaches_the_logs_unless_log_pii_is_on(
    client: Client, smtp: SmtpServer, log_format: str, log_pii: str
) -> None:
    """The address is in the SMTP error and the dead letter's reason, which the dead letter's
    ERROR line quotes: a real worker process writes it in full nowhere, by default, until the
    run is over (Celery's own line about it)."""
    address = "jenny.rosen@example.com"
    smtp.handler.faults.refuse = {address}
    worker = launch.celery_worker(
        worker_env(smtp.port, LOG_FORMAT=log_format, LOG_PII=log_pii), name=f"pii-{log_format}"
    )
    try:
        worker.wait_ready()
        event = paid_event(customer_email=address)
        assert post_event(client, stripe_events.encode(event)).status_code == 200
        assert wait_until(lambda: "dead-lettered" in worker.log_text(), timeout=30)
        assert wait_until(lambda: "succeeded in" in worker.log_text(), timeout=10)
    finally:
        worker.stop()

    output = worker.log_text()
    if log_pii == "1":
        assert address in output
        return
    assert address not in output
    assert "jenny.rosen" not in output
    assert "j***@example.com" in output  # the domain stays: a provider's trouble shows
    if log_format == "json":
        for line in output.splitlines():
            if line.startswith("{"):
                json.loads(line)  # masking kept every line valid JSON
