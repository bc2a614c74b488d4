"""Webhook deliveries by outcome, and events of another Stripe API version than
``STRIPE_API_VERSION``, counted in the web process (summed over gunicorn's workers through
``PROMETHEUS_MULTIPROC_DIR``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

WEBHOOK_DELIVERIES = Counter(
    "invoicing_webhook_deliveries",
    "Webhook deliveries by outcome: accepted, duplicate, rejected (reason: why), shed"
    " (reason: backpressure level), unavailable (database down).",
    ["outcome", "reason"],
)

WEBHOOK_OTHER_API_VERSION = Counter(
    "invoicing_webhook_other_api_version_events",
    "Webhook events stored whose api_version is not STRIPE_API_VERSION, by that version.",
    ["api_version"],
)

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
