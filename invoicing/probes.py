"""The invoicing app's probes (``asyncwork.contrib.monitoring.probes``): its emails and its
provider's breaker, each
declared once with what ``/health/``, ``/metrics`` and the dashboard make of it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlencode

from django.db.models import CharField, Count, F, Func, Q, Sum, Value
from django.urls import reverse
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork.contrib.monitoring.gauges import breaker_check, breaker_figures, breaker_metrics
from asyncwork.contrib.monitoring.metrics import metric_name
from asyncwork.contrib.monitoring.probes import Figure, Probe, breaker_probe, probe_declare
from invoicing.models import EmailDelivery
from invoicing.tasks import email_breaker


@dataclass(frozen=True)
class DeliveryCount:
    """Rows and attempts of one key kind (``invoice_email_sent``...) in one state."""

    kind: str
    state: str
    rows: int
    attempts: int


@dataclass(frozen=True)
class EmailProbe:
    counts: tuple[DeliveryCount, ...]
    sent_last_hour: int
    sent_last_day: int
    measured_at: datetime

    def in_state(self, state: str) -> int:
        return sum(count.rows for count in self.counts if count.state == state)


def email_probe() -> EmailProbe:
    """One grouped scan of ``EmailDelivery``, bounded by its caller's statement timeout."""
    now = timezone.now()
    kind = Func(F("key"), Value(":"), Value(1), function="split_part", output_field=CharField())
    rows = (
        EmailDelivery.objects.annotate(kind=kind)
        .values("kind", "state")
        .annotate(
            n=Count("pk"),
            attempts=Sum("attempts"),
            hour=Count("pk", filter=Q(sent_at__gte=now - timedelta(hours=1))),
            day=Count("pk", filter=Q(sent_at__gte=now - timedelta(days=1))),
        )
        .order_by("kind", "state")
    )
    counts, hour, day = [], 0, 0
    for row in rows:
        counts.append(DeliveryCount(row["kind"], row["state"], row["n"], row["attempts"]))
        hour += row["hour"]
        day += row["day"]
    return EmailProbe(counts=tuple(counts), sent_last_hour=hour, sent_last_day=day, measured_at=now)


def _deliveries(**query: str) -> str:
    return f"{reverse('admin:invoicing_emaildelivery_changelist')}?{urlencode(query)}"


def email_figures(probe: EmailProbe) -> list[Figure]:
    def sent_since(delta: timedelta) -> str:
        since = (probe.measured_at - delta).replace(microsecond=0).isoformat()
        return _deliveries(state="sent", sent_at__gte=since)

    sending, failed = probe.in_state("sending"), probe.in_state("failed")
    pending = probe.in_state("pending")
    return [
        Figure("sent in the last hour", str(probe.sent_last_hour), sent_since(timedelta(hours=1))),
        Figure("sent in the last day", str(probe.sent_last_day), sent_since(timedelta(days=1))),
        Figure("being sent now", str(sending), _deliveries(state="sending")),
        Figure(
            "failed (retrying, or dead-lettered)",
            str(failed),
            _deliveries(state="failed"),
            status="degraded" if failed else "ok",
        ),
        Figure("requested, not yet claimed", str(pending), _deliveries(state="pending")),
    ]


def email_metrics(probe: EmailProbe) -> list[Metric]:
    """Emails sent, attempts and deliveries by state, per key kind; past the statement timeout
    this source drops out of the scrape, reported."""
    sent = CounterMetricFamily(
        metric_name("emails_sent"), "Emails sent (EmailDelivery rows marked sent).", labels=["kind"]
    )
    attempts = CounterMetricFamily(
        metric_name("email_send_attempts"),
        "Attempts to send an email: claims taken on its key, over all workers and retries.",
        labels=["kind"],
    )
    deliveries = GaugeMetricFamily(
        metric_name("email_deliveries"),
        "EmailDelivery rows by state (pending, sending, sent, failed).",
        labels=["kind", "state"],
    )
    for count in probe.counts:
        deliveries.add_metric([count.kind, count.state], count.rows)
    for kind in dict.fromkeys(count.kind for count in probe.counts):
        of_kind = [count for count in probe.counts if count.kind == kind]
        sent.add_metric([kind], sum(c.rows for c in of_kind if c.state == EmailDelivery.State.SENT))
        attempts.add_metric([kind], sum(c.attempts for c in of_kind))
    return [sent, attempts, deliveries]


probe_declare(
    Probe(
        "emails",
        email_probe,
        database=True,
        metrics=email_metrics,
        title="Emails",
        figures=email_figures,
    )
)


probe_declare(
    Probe(
        "email_breaker",
        lambda: breaker_probe(email_breaker()),
        database=False,
        # Not critical: while the breaker is open emails wait, and webhooks are still taken.
        check=breaker_check,
        critical=False,
        check_name="breaker",
        metrics=breaker_metrics,
        title="Email provider (circuit breaker)",
        figures=breaker_figures,
    )
)
