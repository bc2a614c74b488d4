"""The webhooks app's probes (``asyncwork.probes``): events of another Stripe API version than
``STRIPE_API_VERSION`` received in the last 24 h, in /health/'s details (an account upgrade made
visible; never degraded: such an event is taken when its fields parse); and the Events API
reconcile (``webhooks.reconcile``): its last run, its cursor and what it recovered, on
/health/, /metrics and the dashboard, degraded while its last run stopped on a failure.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlencode

from django.conf import settings
from django.urls import reverse
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork.probes import CheckResult, Figure, Probe, probe_declare
from webhooks.models import EventsCursor, WebhookEvent
from webhooks.reconcile import JOB
from webhooks.stripe_api import API_OFF

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


def reconcile_probe() -> EventsCursor | None:
    """The reconcile's cursor row; None while the API is off."""
    if not settings.STRIPE_API_KEY:
        return None
    return EventsCursor.objects.filter(name=JOB).first() or EventsCursor(name=JOB)


def _when(value: object) -> str:
    return f"{value:%Y-%m-%d %H:%M:%S} UTC" if value else "never"


def reconcile_check(cursor: EventsCursor | None) -> CheckResult:
    if cursor is None:
        return {"status": "ok", "reconcile": "off", "why": API_OFF}
    return {
        "status": "degraded" if cursor.last_error else "ok",
        "last_run": cursor.last_run_at,
        "last_run_did": cursor.last_summary or None,
        "covered_until": cursor.covered_until,
        "recovered_last_run": cursor.last_recovered,
        "recovered_total": cursor.recovered_total,
    }


def reconcile_figures(cursor: EventsCursor | None) -> list[Figure]:
    if cursor is None:
        return [Figure("Events API", "off: STRIPE_API_KEY is not set")]
    recovered = reverse("admin:webhooks_webhookevent_changelist")
    recovered += "?" + urlencode({"source__exact": WebhookEvent.Source.EVENTS_API})
    return [
        Figure(
            "last run",
            f"{_when(cursor.last_run_at)}: {cursor.last_summary or '-'}",
            status="degraded" if cursor.last_error else "ok",
        ),
        Figure("every event recorded up to", _when(cursor.covered_until)),
        Figure("recovered in the last run", str(cursor.last_recovered), recovered),
        Figure("recovered in all", str(cursor.recovered_total), recovered),
    ]


def reconcile_metrics(cursor: EventsCursor | None) -> list[Metric]:
    """Events recovered, and how old the cursor is: it grows while no walk ends (the alert)."""
    if cursor is None:
        return []
    recovered = CounterMetricFamily(
        "invoicing_stripe_events_recovered",
        "Events recorded from Stripe's Events API that no webhook had delivered.",
    )
    recovered.add_metric([], cursor.recovered_total)
    age = GaugeMetricFamily(
        "invoicing_stripe_reconcile_cursor_age_seconds",
        "Seconds since the time up to which every event of the handled types is recorded.",
    )
    if cursor.covered_until is not None:
        age.add_metric([], (timezone.now() - cursor.covered_until).total_seconds())
    return [recovered, age]


probe_declare(
    Probe(
        "stripe_reconcile",
        reconcile_probe,
        database=True,
        check=reconcile_check,
        # Not critical: the webhooks carry the application, the reconcile fills their gaps.
        critical=False,
        metrics=reconcile_metrics,
        title="Stripe events reconcile (Events API)",
        figures=reconcile_figures,
    )
)
