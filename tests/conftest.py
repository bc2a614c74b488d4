from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.smtp import SmtpServer, free_port
from webhooks import testing as stripe_testing

ROOT = Path(__file__).resolve().parents[1]
SECRET = "whsec_test_primary"
WEBHOOK_URL = "/webhooks/stripe/"


def post_event(
    client: Client,
    body: bytes,
    *,
    secret: str = SECRET,
    timestamp: int | None = None,
    header: str | None = None,
    **extra: Any,
) -> Any:
    if header is None:
        header = stripe_testing.signature_header(body, secret, timestamp=timestamp)
    return client.post(
        WEBHOOK_URL,
        data=body,
        content_type="application/json",
        HTTP_STRIPE_SIGNATURE=header,
        **extra,
    )


def paid_event(
    invoice_id: str | None = None,
    *,
    event_type: str = "invoice.paid",
    created: int | None = None,
    **invoice: Any,
) -> dict[str, Any]:
    invoice_id = invoice_id or stripe_testing.new_id("in")
    return stripe_testing.event(
        event_type,
        stripe_testing.invoice_object(invoice_id=invoice_id, **invoice),
        created=created,
    )


def use_smtp(settings: Any, port: int) -> None:
    # The test runner swaps in the locmem backend; these tests talk SMTP for real.
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = port


@pytest.fixture
def smtp(settings: Any) -> Iterator[SmtpServer]:
    """A real SMTP server for this test; Django's email settings point at it."""
    server = SmtpServer().start()
    use_smtp(settings, server.port)
    yield server
    server.stop()


@pytest.fixture
def smtp_unreachable(settings: Any) -> int:
    """Django's email settings point at a port where nothing listens."""
    port = free_port()
    use_smtp(settings, port)
    return port


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
