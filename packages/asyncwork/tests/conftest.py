"""A worker of the test app's own, in this process (Celery's test worker: the real consumer on
the real broker, one thread), and the run's broker keys deleted when the run ends."""

from collections.abc import Iterator

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from django.conf import settings
from shop.celery import app


@pytest.fixture(scope="session", autouse=True)
def _broker_keys_deleted() -> Iterator[None]:
    yield
    prefix = settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"]
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)


@pytest.fixture
def worker(transactional_db: None) -> Iterator[None]:
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        yield
