"""Test settings: core.settings with a broker key prefix and cache prefix of this run's own,
so test runs (and the worker processes they start) never consume each other's tasks, and
short retry delays so exhausting five attempts takes seconds."""

import os
import uuid

_RUN = os.environ.setdefault("TEST_RUN_ID", uuid.uuid4().hex[:10])
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("CELERY_BROKER_KEY_PREFIX", f"test-{_RUN}:")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("REDIS_KEY_PREFIX", f"test-{_RUN}")
os.environ.setdefault("EMAIL_RETRY_BACKOFF_BASE", "1")
os.environ.setdefault("EMAIL_RETRY_BACKOFF_MAX", "2")
os.environ.setdefault("STRIPE_WEBHOOK_SECRET", "whsec_test_primary,whsec_test_rolled")
os.environ.setdefault("OUTBOX_RELAY_GRACE_SECONDS", "0")
# The events the tests sign are test-mode events (livemode false, as webhooks/testing.py makes
# them), whatever DJANGO_DEBUG is: the endpoint under test acts on test mode.
os.environ.setdefault("STRIPE_LIVEMODE", "test")

from core.settings import *  # noqa: E402, F403
from core.settings import DATABASES  # noqa: E402

# The test database is this run's own: two runs at once (or a run beside the developer's
# ``invoicing`` database) never create, flush or drop each other's.
DATABASES["default"]["TEST"] = {"NAME": f"test_invoicing_{_RUN}"}
