"""The floor sender: the least work any sender that keeps "one email per paid invoice" must do
per email, in Python. A reference arm of the benchmarks, loaded into the same Celery workers as
the application (``--include bench.floor_sender``: same broker, pool and worker count); never
imported by the application.

Per message (``bench.floor_send(invoice_id)``, published by ``bench.floor_receiver``): claim
the ``invoice_email_sent:<id>`` key with one statement (which also reads the recipient), send
one message over the SMTP connection this worker process keeps, mark the key sent. No breaker,
no retries, no dead letters, no logging, no metrics, no templates: what it skips is what the
application pays for on top of the floor.
"""

from __future__ import annotations

import hashlib
import os
import smtplib
from typing import Any

import psycopg
from celery import shared_task

FLOOR_TASK = "bench.floor_send"

# Insert the key for an invoice that has none; a key already there (sent, or held) is not
# claimed. The recipient comes back with the claim.
_CLAIM = """
WITH invoice AS (
    SELECT id, provider_invoice_id, customer_email FROM invoicing_invoice WHERE id = %(id)s
), claim AS (
    INSERT INTO invoicing_emaildelivery
        (key, invoice_id, state, attempts, claimed_by, message_id, provider_message_id,
         recipient, last_error, requested_by, created_at, updated_at)
    SELECT 'invoice_email_sent:' || id, id, 'sending', 1, %(owner)s, '', '', '', '', '', now(),
           now()
    FROM invoice
    ON CONFLICT (key) DO NOTHING
    RETURNING id
)
SELECT claim.id, invoice.provider_invoice_id, invoice.customer_email FROM claim, invoice
"""
_MARK = "UPDATE invoicing_emaildelivery SET state = 'sent', sent_at = now() WHERE id = %s"

_process: dict[str, Any] = {}


def _state() -> dict[str, Any]:
    if _process.get("pid") != os.getpid():
        _process.clear()
        _process.update(
            pid=os.getpid(),
            database=psycopg.connect(os.environ["DATABASE_URL"], autocommit=True),
            owner=f"floor@{os.getpid()}",
        )
    return _process


def _smtp(state: dict[str, Any]) -> smtplib.SMTP:
    if state.get("smtp") is None:
        state["smtp"] = smtplib.SMTP(
            os.environ["EMAIL_HOST"], int(os.environ["EMAIL_PORT"]), timeout=10
        )
    return state["smtp"]


@shared_task(name=FLOOR_TASK, ignore_result=True)
def floor_send(invoice_id: int) -> None:
    state = _state()
    row = state["database"].execute(_CLAIM, {"id": invoice_id, "owner": state["owner"]}).fetchone()
    if row is None:
        return  # sent or held already
    delivery_id, provider_id, recipient = row
    digest = hashlib.sha256(f"invoice_email_sent:{invoice_id}".encode()).hexdigest()[:16]
    message = (
        f"From: billing@example.com\r\nTo: {recipient}\r\nSubject: Invoice {provider_id}\r\n"
        f"Message-ID: <{provider_id}.{digest}@floor.invalid>\r\n\r\nPaid, thank you.\r\n"
    ).encode()
    try:
        _smtp(state).sendmail("billing@example.com", [recipient], message)
    except smtplib.SMTPServerDisconnected:
        # The kept connection was dropped before this message: once more on a new one.
        state["smtp"] = None
        _smtp(state).sendmail("billing@example.com", [recipient], message)
    state["database"].execute(_MARK, [delivery_id])
