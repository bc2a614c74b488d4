from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from bench.harness import Server
from tests import web
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


def post_signed(url: str, body: bytes) -> Any:
    """POST ``body`` signed like Stripe over real HTTP (a live server, gunicorn, the edge)."""
    import requests

    return requests.post(
        url,
        data=body,
        headers={
            "Content-Type": "application/json",
            "Stripe-Signature": stripe_testing.signature_header(body, SECRET),
        },
        timeout=10,
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
    settings.EMAIL_BACKEND = "core.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = port


@pytest.fixture
def smtp(settings: Any) -> Iterator[SmtpServer]:
    """A real SMTP server for this test; Django's email settings point at it."""
    server = SmtpServer().start()
    use_smtp(settings, server.port)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _broker_empty() -> Iterator[None]:
    """Every test starts and ends with this run's broker keys gone: a message a test published
    and no worker consumed (an outbox publish, a dead letter's copy) must not reach the next
    test's worker."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    pattern = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "*"

    def purge() -> None:
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)

    purge()
    yield
    purge()
    client.close()


@pytest.fixture(autouse=True)
def _email_breaker_closed() -> Iterator[None]:
    """Every test starts and ends with the email provider's breaker closed: its state lives
    in Redis, shared by the whole run, and a test that trips it must not defer the next's."""
    from invoicing.services import email_breaker

    email_breaker().reset()
    yield
    email_breaker().reset()


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


@pytest.fixture(scope="session")
def collected_static(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A STATIC_ROOT filled by the Docker image's own collectstatic step (tests/web.py), once
    per run."""
    return web.collect_static(tmp_path_factory.mktemp("staticfiles"))


@pytest.fixture
def production_web(
    transactional_db: None, collected_static: Path, tmp_path: Path
) -> Iterator[Server]:
    """gunicorn as deployed: core.settings (DEBUG off), WhiteNoise serving the collected static
    files, on this run's test database. One per test: a transactional test's flush recreates
    the content types under new ids, and a gunicorn process that outlived its test would still
    look rows up by the ids it cached (an operator action's target, on the invoice page)."""
    with web.production_gunicorn(collected_static, log_path=tmp_path / "gunicorn.log") as server:
        yield server
