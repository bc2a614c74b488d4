"""The floor sender (``bench/floor_sender.py``), called as the worker calls it, against the real
PostgreSQL and SMTP server: its one claim statement still fits the application's tables (a NOT
NULL column the application adds breaks it, and then every floor email of a benchmark fails),
it sends one email per invoice, and a second call for the same invoice sends nothing."""

from __future__ import annotations

import pytest
from django.db import connection
from psycopg.conninfo import make_conninfo

from bench import floor_sender
from invoicing.models import EmailDelivery
from stack.smtp import SmtpServer
from tests.helpers.factories import paid_invoice

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_floor_sender_claims_sends_and_marks_one_email_per_invoice(
    smtp: SmtpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = connection.settings_dict
    conninfo = make_conninfo(
        **{
            name: value
            for name, value in {
                "dbname": database["NAME"],
                "host": database["HOST"],
                "port": database["PORT"],
                "user": database["USER"],
                "password": database["PASSWORD"],
            }.items()
            if value
        }
    )
    monkeypatch.setenv("DATABASE_URL", conninfo)
    monkeypatch.setenv("EMAIL_HOST", "127.0.0.1")
    monkeypatch.setenv("EMAIL_PORT", str(smtp.port))
    monkeypatch.setattr(floor_sender, "_process", {})
    invoice = paid_invoice("in_floor_sender", customer_email="floor@example.com")
    try:
        floor_sender.floor_send(invoice.pk)
        floor_sender.floor_send(invoice.pk)
    finally:
        floor_sender._process["database"].close()
        floor_sender._process["smtp"].quit()

    assert smtp.handler.wait_for(1, timeout=5)
    (email,) = smtp.handler.received()
    assert email.recipient == "floor@example.com"
    delivery = EmailDelivery.objects.get()
    assert (delivery.key, delivery.state) == (f"invoice_email_sent:{invoice.pk}", "sent")
