"""Webhook deliveries by outcome, and events acted on in another Stripe API version than
``STRIPE_API_VERSION``, counted in the web process (summed over gunicorn's workers through
``PROMETHEUS_MULTIPROC_DIR``).

Every label value is one of a bounded set: the outcomes and reasons are fixed strings, and an
event's ``api_version`` (the sender's text) becomes a label only when a handler applied the
event and it reads as Stripe's versions read; any other text is counted as ``other``."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from prometheus_client import Counter

from asyncwork.contrib.monitoring.metrics import metric_name

WEBHOOK_DELIVERIES = Counter(
    metric_name("webhook_deliveries"),
    "Webhook deliveries by outcome: accepted, duplicate, rejected (reason: why), shed"
    " (reason: backpressure level), unavailable (database down).",
    ["outcome", "reason"],
)

WEBHOOK_OTHER_API_VERSION = Counter(
    metric_name("webhook_other_api_version_events"),
    "Webhook events a handler applied whose api_version is not STRIPE_API_VERSION, by that"
    " version (other: one that does not read as a Stripe API version).",
    ["api_version"],
)
# A release date, with the release's name since 2024 ("2024-06-20", "2025-09-30.clover").
STRIPE_VERSION = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:\.[a-z]{1,32})?")
OTHER = "other"

# Each series' child, looked up once (``labels()`` costs more than the increment); filled on
# first use, as in multiprocess mode each child is a file.
_webhook_series: dict[tuple[str, str], Any] = {}


def webhook_delivery_count(outcome: str, reason: str = "") -> None:
    """One webhook delivery answered with ``outcome`` (reasons are fixed strings)."""
    child = _webhook_series.get((outcome, reason))
    if child is None:
        child = _webhook_series.setdefault(
            (outcome, reason), WEBHOOK_DELIVERIES.labels(outcome=outcome, reason=reason)
        )
    child.inc()


def other_api_version_count(api_version: str) -> None:
    """One event a handler applied, rendered in ``api_version``: counted when that is neither
    ``STRIPE_API_VERSION`` nor missing, under its own label only if it reads as Stripe's."""
    if api_version in ("", settings.STRIPE_API_VERSION):
        return
    label = api_version if STRIPE_VERSION.fullmatch(api_version) else OTHER
    WEBHOOK_OTHER_API_VERSION.labels(api_version=label).inc()
