"""The webhooks app's probes (``asyncwork.contrib.monitoring.probes``): events of another Stripe API
version than ``STRIPE_API_VERSION`` received in the last 24 h, in /health/'s details (an account
upgrade made visible; never degraded: such an event is taken when its fields parse); and the Events
API reconcile (``webhooks.reconcile``): its last run, its cursor and what it recovered, on /health/,
/metrics and the dashboard, degraded while its last run stopped on a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlencode

from django.conf import settings
from django.urls import reverse
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.contrib.monitoring.probes import CheckResult, Figure, Probe, probe_declare
from asyncwork.models import ScheduledJob
from webhooks.models import EventsCursor, WebhookEvent
from webhooks.reconcile import JOB, TIME
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
        "api_versions", other_api_versions, database=True, check=api_versions_check, critical=False
    )
)


@dataclass(frozen=True)
class ReconcileProbe:
    """The reconcile's cursor, and its job's row (when the last run started, what it did)."""

    cursor: EventsCursor
    job: ScheduledJob

    @property
    def last_run(self) -> str:
        when = self.job.last_started_at
        return f"{when:%Y-%m-%d %H:%M:%S} UTC: {self.job.last_result}" if when else "never"


def reconcile_probe() -> ReconcileProbe | None:
    """None while the API is off."""
    if not settings.STRIPE_API_KEY:
        return None
    return ReconcileProbe(
        cursor=EventsCursor.objects.filter(name=JOB).first() or EventsCursor(name=JOB),
        job=ScheduledJob.objects.filter(name=JOB).first() or ScheduledJob(name=JOB),
    )


def reconcile_check(probe: ReconcileProbe | None) -> CheckResult:
    if probe is None:
        return {"status": "ok", "reconcile": "off", "why": API_OFF}
    return {
        "status": "degraded" if probe.cursor.last_error else "ok",
        "last_run": probe.job.last_started_at,
        "last_run_did": probe.job.last_result or None,
        # Every event created in between is recorded; a walk under way lists back to its since.
        "covered_from": probe.cursor.covered_from,
        "covered_until": probe.cursor.covered_until,
        "walk_since": probe.cursor.walk_since,
        "recovered_last_run": probe.cursor.last_recovered,
        "recovered_total": probe.cursor.recovered_total,
    }


def reconcile_figures(probe: ReconcileProbe | None) -> list[Figure]:
    if probe is None:
        return [Figure("Events API", "off: STRIPE_API_KEY is not set")]
    recovered = reverse("admin:webhooks_webhookevent_changelist")
    recovered += "?" + urlencode({"source__exact": WebhookEvent.Source.EVENTS_API})
    cursor = probe.cursor
    covered = "-"
    if cursor.covered_from and cursor.covered_until:
        covered = f"{cursor.covered_from:{TIME}} to {cursor.covered_until:{TIME}} UTC"
    walk = f"back to {cursor.walk_since:{TIME}} UTC" if cursor.walk_since else "-"
    return [
        Figure("last run", probe.last_run, status="degraded" if cursor.last_error else "ok"),
        Figure("every event recorded", covered),
        Figure("walk under way", walk),
        Figure("recovered in the last run", str(cursor.last_recovered), recovered),
        Figure("recovered in all", str(cursor.recovered_total), recovered),
    ]


def reconcile_metrics(probe: ReconcileProbe | None) -> list[Metric]:
    """Events recovered, and how old the cursor is: it grows while no walk ends (the alert)."""
    if probe is None:
        return []
    cursor = probe.cursor
    recovered = CounterMetricFamily(
        metric_name("stripe_events_recovered"),
        "Events recorded from Stripe's Events API that no webhook had delivered.",
    )
    recovered.add_metric([], cursor.recovered_total)
    age = GaugeMetricFamily(
        metric_name("stripe_reconcile_cursor_age_seconds"),
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
