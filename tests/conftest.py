"""Fixtures only; the helpers they use, and the tests' own, are in ``tests/helpers``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings

from invoicing.services import email_breaker
from stack.net import free_port
from stack.process import Process
from stack.smtp import SmtpServer
from tests.helpers import web
from tests.helpers.mail import use_smtp


@pytest.fixture
def smtp(settings: Any) -> Iterator[SmtpServer]:
    """A real SMTP server for this test; Django's email settings point at it."""
    with SmtpServer() as server:
        use_smtp(settings, server.port)
        yield server


@pytest.fixture(autouse=True)
def _broker_empty() -> Iterator[None]:
    """Every test starts and ends with this run's broker keys gone: a message a test published
    and no worker consumed (an outbox publish, a dead letter's copy) must not reach the next
    test's worker."""
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    pattern = django_settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] + "*"

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
    email_breaker().reset()
    yield
    email_breaker().reset()


@pytest.fixture
def smtp_unreachable(settings: Any) -> int:
    """Django's email settings point at a port where nothing listens."""
    port = free_port()
    use_smtp(settings, port)
    return port


@pytest.fixture(scope="session")
def collected_static(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A STATIC_ROOT filled by the Docker image's own collectstatic step (tests/helpers/web.py),
    once per run."""
    return web.collect_static(tmp_path_factory.mktemp("staticfiles"))


@pytest.fixture
def production_web(
    transactional_db: None, collected_static: Path, tmp_path: Path
) -> Iterator[Process]:
    """gunicorn as deployed: core.settings (DEBUG off), WhiteNoise serving the collected static
    files, on this run's test database. One per test: a transactional test's flush recreates
    the content types under new ids, and a gunicorn process that outlived its test would still
    look rows up by the ids it cached (an operator action's target, on the invoice page)."""
    with web.production_gunicorn(collected_static, log_path=tmp_path / "gunicorn.log") as server:
        yield server
