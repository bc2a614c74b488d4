"""The webhooks app's probe (``asyncwork.probes``): events of another Stripe API version than
``STRIPE_API_VERSION`` received in the last 24 h, in /health/'s details. It shows an account
upgrade and never degrades /health/: such an event is taken when its fields parse."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from asyncwork.probes import CheckResult, Probe, probe_declare
from webhooks.models import WebhookEvent

WINDOW = timedelta(hours=24)
# Counted up to this per version: cheap however many events an upgrade brings.
CAP = 10000


def other_api_versions() -> dict[str, int]:
    """Events of each other version in the window (a thin event has none and is not counted).

    One index probe per version stored (a handful), then one index range per other version
    (``webhook_version_idx``): nothing here reads the expected version's events."""
    since = timezone.now() - WINDOW
    stored = WebhookEvent.objects.order_by("api_version").values_list("api_version", flat=True)
    found: dict[str, int] = {}
    version = stored.filter(api_version__gt="").first()
    while version is not None:
        if version != settings.STRIPE_API_VERSION:
            events = WebhookEvent.objects.filter(api_version=version, received_at__gte=since)
            if count := events[:CAP].count():
                found[version] = count
        version = stored.filter(api_version__gt=version).first()
    return found


def api_versions_check(found: dict[str, int]) -> CheckResult:
    return {
        "status": "ok",
        "api_version": settings.STRIPE_API_VERSION,
        "other_versions_last_24h": sum(found.values()),
        "other_versions": found,
    }


probe_declare(
    Probe(
        "api_versions",
        other_api_versions,
        database=True,
        check=api_versions_check,
        critical=False,
    )
)
