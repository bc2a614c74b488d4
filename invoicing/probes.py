"""The invoicing app's probes (``asyncwork.probes``), read by ``/metrics``, ``/health/`` and the
admin dashboard alike."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import CharField, Count, F, Func, Q, Sum, Value
from django.urls import reverse
from django.utils import timezone

from asyncwork.dashboard import breaker_figures
from asyncwork.health import health_check
from asyncwork.probes import BreakerProbe, Figure, breaker_probe, dashboard_probe
from invoicing.models import EmailDelivery
from invoicing.services import email_breaker


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


def email_breaker_probe() -> BreakerProbe:
    return breaker_probe(email_breaker())


@health_check("breaker", critical=False)
def email_breaker_check() -> dict[str, Any]:
    """Not critical: while the breaker is open emails wait, and webhooks are still taken."""
    breaker = email_breaker_probe()
    status = {"closed": "ok", "open": "degraded", "half-open": "degraded"}.get(
        breaker.state, "unknown"
    )
    return {"status": status, **breaker.as_dict()}


def _deliveries(**query: str) -> str:
    return f"{reverse('admin:invoicing_emaildelivery_changelist')}?{urlencode(query)}"


@dashboard_probe("emails", email_probe, title="Emails", database=True)
def email_figures(probe: EmailProbe) -> list[Figure]:
    def since(delta: timedelta) -> str:
        return (probe.measured_at - delta).replace(microsecond=0).isoformat()

    sending, failed = probe.in_state("sending"), probe.in_state("failed")
    return [
        Figure(
            "sent in the last hour",
            str(probe.sent_last_hour),
            _deliveries(state="sent", sent_at__gte=since(timedelta(hours=1))),
        ),
        Figure(
            "sent in the last day",
            str(probe.sent_last_day),
            _deliveries(state="sent", sent_at__gte=since(timedelta(days=1))),
        ),
        Figure("being sent now", str(sending), _deliveries(state="sending")),
        Figure(
            "failed (retrying, or dead-lettered)",
            str(failed),
            _deliveries(state="failed"),
            status="degraded" if failed else "ok",
        ),
        Figure(
            "requested, not yet claimed",
            str(probe.in_state("pending")),
            _deliveries(state="pending"),
        ),
    ]


@dashboard_probe(
    "email_breaker",
    email_breaker_probe,
    title="Email provider (circuit breaker)",
    database=False,
)
def email_breaker_figures(probe: BreakerProbe) -> list[Figure]:
    return breaker_figures(probe)
