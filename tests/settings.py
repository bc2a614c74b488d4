"""Test settings: core.settings, with every resource a test run touches made its own, and
short retry delays so exhausting five attempts takes seconds.

What a run shares with the machine, and why, and how it stays out of others' way:

* PostgreSQL at 127.0.0.1:5432 (the machine's server: starting one per run would cost more
  than the run's slowest test): a test database of the run's own, ``test_invoicing_<run
  id>``, created and dropped by pytest-django; tests that need more (the demo, fresh-database
  migrations) create databases of their own and drop them.
* Redis at 127.0.0.1:6379 (the machine's server, for the same reason): databases 14 (cache)
  and 15 (broker), under key prefixes of the run's own, deleted by the run (tests/conftest.py
  ``_broker_empty``); the demo's test uses database 13 under the demo's own prefix. Nothing
  flushes a database.
* Ports: every server a test starts (SMTP, gunicorn, nginx, workers' metrics) binds a free
  port of its own on loopback.
* RabbitMQ at 127.0.0.1:5672 when ``TESTS_BROKER=rabbitmq``: a virtual host of the run's own,
  ``test-<run id>``, created when the run starts and deleted when it ends, failed or not
  (``tests/conftest.py``).
* The chaos suite's test runs its own PostgreSQL cluster and redis-server, which it restarts.

So running ``make test`` twice at once, or beside ``make demo`` or a local stack, changes
nothing outside each run's own resources. Under pytest-xdist (``make test`` runs three test
processes) each process is a run of its own: the run id with the process's name after it."""

import json
import os
import uuid

# Set, not defaulted: what a developer exported for their own use (DJANGO_DEBUG=1, the
# whsec_... of `stripe listen`) must not change what the tests run, and the tests sign their
# events with these secrets (tests/helpers/stripe.py). The processes the tests start (workers,
# gunicorn, manage.py) inherit them through this process's environment.
os.environ.update(
    {
        # DEBUG off, as in production. The test runner (pytest-django, like Django's own)
        # forces settings.DEBUG to False in this process anyway; setting it here keeps the
        # processes the tests start, which read this module but are not under the runner, on
        # the same production code path.
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": "tests-only-secret-key-" + "0123456789abcdef" * 3,
        "STRIPE_WEBHOOK_SECRET": "whsec_test_primary,whsec_test_rolled",
        # The Stripe API off: a test that reads it points the client at the kit's stand-in
        # (tests/conftest.py stripe_api), never at Stripe with a developer's key.
        "STRIPE_API_KEY": "",
        # No HTTPS redirect (nor Secure-only cookies, nor HSTS), which DEBUG off would turn on:
        # the tests speak plain HTTP (the test client, live_server, gunicorn on loopback).
        # tests/core/test_settings.py covers the HTTPS settings themselves.
        "DJANGO_SECURE_SSL_REDIRECT": "0",
    }
)
_BASE = os.environ.setdefault("TEST_RUN_ID", uuid.uuid4().hex[:10])
# Each pytest-xdist worker is a run of its own (its database, key prefixes, virtual host); the
# processes its tests start inherit the worker's name, and so its resources.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_RUN = _BASE + _WORKER


def _run_own(name: str, value: str) -> None:
    """``name`` is ``value``, a resource named after the run, unless the developer set it; under
    pytest-xdist the value the controller process set (after the run alone) is the worker's."""
    current = os.environ.get(name)
    if current is None or (_WORKER and current == value.replace(_RUN, _BASE)):
        os.environ[name] = value


# The broker: Redis unless TESTS_BROKER=rabbitmq (not TEST_BROKER: Celery's test worker takes
# that for the broker's host name), which runs the tests that prove the pipeline
# through the broker (tests/helpers/broker.py BOTH_BROKERS) on the machine's RabbitMQ, in a virtual
# host of the run's own that the run creates and deletes. The delivery limit is lowered so
# that a poison message is dead-lettered after three deliveries, not ten.
TESTS_BROKER = os.environ.setdefault("TESTS_BROKER", "redis")
if TESTS_BROKER == "rabbitmq":
    _run_own("CELERY_BROKER_URL", f"amqp://guest:guest@127.0.0.1:5672/test-{_RUN}")
elif TESTS_BROKER != "redis":
    raise ValueError(f"TESTS_BROKER={TESTS_BROKER!r}: redis or rabbitmq")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
_run_own("CELERY_BROKER_KEY_PREFIX", f"test-{_RUN}:")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")
_run_own("REDIS_KEY_PREFIX", f"test-{_RUN}")
os.environ.setdefault("EMAIL_RETRY_BACKOFF_BASE", "1")
os.environ.setdefault("EMAIL_RETRY_BACKOFF_MAX", "2")
# The events the tests sign are test-mode events (livemode false, as stack/stripe_events.py makes
# them), whatever DJANGO_DEBUG is: the endpoint under test acts on test mode.
os.environ.setdefault("STRIPE_LIVEMODE", "test")

from core.settings import *  # noqa: E402, F403
from core.settings import (  # noqa: E402
    ASYNCWORK,
    CELERY_BROKER_TRANSPORT_OPTIONS,
    DATABASES,
    STORAGES,
)

# A poison message is dead-lettered after three deliveries, not ten.
ASYNCWORK = {**ASYNCWORK, "BROKER_DELIVERY_LIMIT": 3, "OUTBOX_RELAY_GRACE_SECONDS": 0}
# Redis's visibility timeout, which a test's processes may scale down (TEST_SETTINGS).
TEST_VISIBILITY_TIMEOUT = CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout")
# A process a test starts may take settings of its own that production reads from no
# variable (timing scaled down, a URLconf): tests/helpers/processes.py worker_env(settings=...).
globals().update(json.loads(os.environ.get("TEST_SETTINGS", "{}")))
if "visibility_timeout" in CELERY_BROKER_TRANSPORT_OPTIONS:  # Redis: the scaled one, if any
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        **CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": TEST_VISIBILITY_TIMEOUT,
        # A worker stops once its pending BRPOP returns: within 0.1 s, not kombu's 1 s, at the
        # end of every test that runs one.
        "polling_interval": 0.1,
    }

# Passwords hashed in microseconds, not PBKDF2's deliberate half-second (Django's advice for
# tests): the login tests prove the limit and the form, not the hash's cost. The processes the
# tests start (gunicorn, manage.py) read this module too, so a password set here checks there.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The test database is this run's own: two runs at once (or a run beside the developer's
# ``invoicing`` database) never create, flush or drop each other's.
DATABASES["default"]["TEST"] = {"NAME": f"test_invoicing_{_RUN}"}
# A commit does not wait for its WAL to reach the disk: only a crash of the server itself could
# lose one, and a test database is made again by every run.
DATABASES["default"]["OPTIONS"]["options"] = "-c synchronous_commit=off"

# Nothing collects static files for the tests, and the manifest storage of production fails any
# page naming a file it has no manifest entry for (the admin's, rendered by the test client in
# many tests): Django's plain storage instead, as Django's docs advise for tests, with
# WhiteNoise finding each file in its app (as with DEBUG on) rather than in a STATIC_ROOT that
# was never filled. The processes tests start on these settings (gunicorn in the edge tests,
# workers) do the same. Production's storage is tested as deployed: gunicorn on core.settings
# after the Docker image's own collectstatic (tests/helpers/web.py; tests/core/test_static.py
# and the browser test).
STORAGES = {
    **STORAGES,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
STATIC_ROOT = None  # type: ignore[assignment]  # none: nothing is collected
WHITENOISE_USE_FINDERS = True
# Each file looked up when asked for, as with DEBUG on, rather than every app's static files
# listed when the middleware starts: the test client starts it again for every client, a few
# hundred times a run.
WHITENOISE_AUTOREFRESH = True
