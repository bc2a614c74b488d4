"""The Stripe API, optional. With ``STRIPE_API_KEY`` set, ``stripe_client()`` is stripe-python's
own client for ``STRIPE_API_BASE``; without one it is None, everything that needs it is off,
and that is said once as a worker starts and in /health/'s details (never as degraded: the
webhooks alone carry the application).

Every call has a timeout and is made once: a job that makes one retries it under its own
bounds, after ``stripe_error_sorted`` told a failure that may pass from one that will not.
"""

from __future__ import annotations

import logging
from typing import Any

import stripe
from celery.signals import worker_ready
from django.conf import settings

from asyncwork.contrib.monitoring.probes import CheckResult, Probe, probe_declare
from asyncwork.errors import PermanentError, TransientError

logger = logging.getLogger(__name__)

API_OFF = "STRIPE_API_KEY is not set: nothing is read from the Stripe API"


def stripe_client() -> stripe.StripeClient | None:
    """A client as the settings are now, or None without a key. Objects are read in
    ``STRIPE_API_VERSION``, the version the handlers are written for."""
    if not settings.STRIPE_API_KEY:
        return None
    return stripe.StripeClient(
        settings.STRIPE_API_KEY,
        stripe_version=settings.STRIPE_API_VERSION,
        base_addresses={"api": settings.STRIPE_API_BASE},
        http_client=stripe.RequestsClient(timeout=settings.STRIPE_API_TIMEOUT_SECONDS),
        max_network_retries=0,
    )


def stripe_error_sorted(exc: stripe.StripeError, *, doing: str) -> TransientError | PermanentError:
    """``exc`` in words, as a job's failure: no answer (a timeout, a refused connection), 429,
    5xx, or an answer that is not Stripe's JSON may pass (``TransientError``); any other answer
    (404, 401, 403...) or a refused certificate will not (``PermanentError``)."""
    if isinstance(exc, stripe.APIConnectionError):
        cause = type(exc.__cause__).__name__ if exc.__cause__ else "no answer"
        failure = TransientError if exc.should_retry else PermanentError
        return failure(f"Stripe API, {doing}: {cause}")
    status = exc.http_status or 0
    said = exc.error.message if exc.error and exc.error.message else "not Stripe's JSON"
    words = f"Stripe API, {doing}: HTTP {status}, {said}"
    if status == 429 or status >= 500 or exc.error is None:
        return TransientError(words)
    return PermanentError(words)


@worker_ready.connect(weak=False, dispatch_uid="webhooks.stripe_api.announce")
def stripe_api_announce(**_: Any) -> None:
    """The one line a worker logs at start when the API is off."""
    if not settings.STRIPE_API_KEY:
        logger.info(API_OFF)


def _api_check(configured: bool) -> CheckResult:
    if configured:
        return {"status": "ok", "api": "on", "base": settings.STRIPE_API_BASE}
    return {"status": "ok", "api": "off", "why": API_OFF}


probe_declare(
    Probe(
        "stripe_api",
        lambda: bool(settings.STRIPE_API_KEY),
        database=False,
        check=_api_check,
        critical=False,
    )
)
