"""Fixtures, and the run's RabbitMQ virtual host; the helpers they use, and the tests' own,
are in ``tests/helpers``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from invoicing.tasks import email_breaker
from stack.net import free_port
from stack.process import Process
from stack.smtp import SmtpServer
from stack.stripe_api import StripeApi
from tests.helpers import broker, database, web
from tests.helpers.admin import admin_as, api_as
from tests.helpers.factories import staff_user
from tests.helpers.mail import use_smtp
from tests.helpers.redis_server import PrivateRedis


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not broker.RABBITMQ or not collection_path.name.startswith("test_"):
        return None
    # TESTS_BROKER=rabbitmq collects the tests that prove the pipeline through the broker only.
    return not broker.runs_on_both(collection_path) or None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The slow tests first (a stable sort: otherwise in the order collected). `make test` hands
    # the modules to its processes in this order, so that no slow module (the chaos suite's
    # takes minutes) starts as the other processes run out of work.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config: pytest.Config) -> None:
    database.flush_by_delete()


def pytest_sessionstart(session: pytest.Session) -> None:
    if broker.vhost_is_the_runs():
        broker.vhost_create(broker.vhost())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Called however the run ends: failed, interrupted, or with nothing collected.
    if broker.vhost_is_the_runs():
        broker.vhost_delete(broker.vhost())


@pytest.fixture
def smtp(settings: Any) -> Iterator[SmtpServer]:
    """A real SMTP server for this test; Django's email settings point at it."""
    with SmtpServer() as server:
        use_smtp(settings, server.port)
        yield server


@pytest.fixture
def stripe_api(settings: Any) -> Iterator[StripeApi]:
    """The kit's stand-in of the Stripe API for this test; the application's client calls it
    with its key, and gives up on an answer after 1 s (its hang lasts 5). Its origin is listed
    as trusted, as a process's start requires of a base that is not Stripe's own (a worker this
    test runs starts with these settings)."""
    with StripeApi() as api:
        settings.STRIPE_API_KEY = api.key
        settings.STRIPE_API_BASE = api.url
        settings.PROVIDER_API_ALLOWED_ORIGINS = [api.url]
        settings.STRIPE_API_TIMEOUT_SECONDS = 1
        yield api


@pytest.fixture(autouse=True)
def _broker_empty() -> Iterator[None]:
    """Every test starts and ends with this run's queues empty: a message a test published
    and no worker consumed (an outbox publish, a retry) must not reach the next test's
    worker."""
    broker.queues_empty()
    yield
    broker.queues_empty()


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


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A redis-server of this test's own (the machine's is shared: never stopped or paused)."""
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def staff() -> Any:
    """The admin as an operator: a staff user in the "operators" group, not a superuser."""
    return admin_as(staff_user("op", groups=["operators"]))


@pytest.fixture
def viewer() -> Any:
    """The admin as a staff user in the "viewers" group: sees every list, acts on nothing."""
    return admin_as(staff_user("watcher", groups=["viewers"]))


@pytest.fixture
def api_staff() -> Any:
    """The API as an operator."""
    return api_as(staff_user("op", groups=["operators"]))


@pytest.fixture
def api_viewer() -> Any:
    """The API as a viewer: reading is all it may do."""
    return api_as(staff_user("op", groups=["viewers"]))
