"""The invoicing app's scrape-time figures for ``/metrics`` (``asyncwork.metrics``), read from
the database and Redis: exact across workers and restarts."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncwork.gauges import breaker_metrics
from asyncwork.metrics import metrics_source
from invoicing.models import EmailDelivery
from invoicing.probes import email_breaker_probe, email_probe


@metrics_source("emails", database=True)
def email_delivery_metrics() -> list[Metric]:
    """Emails sent, attempts and deliveries by state, per key kind; past the statement timeout
    this source drops out of the scrape, reported."""
    sent = CounterMetricFamily(
        "invoicing_emails_sent", "Emails sent (EmailDelivery rows marked sent).", labels=["kind"]
    )
    attempts = CounterMetricFamily(
        "invoicing_email_send_attempts",
        "Attempts to send an email: claims taken on its key, over all workers and retries.",
        labels=["kind"],
    )
    deliveries = GaugeMetricFamily(
        "invoicing_email_deliveries",
        "EmailDelivery rows by state (pending, sending, sent, failed).",
        labels=["kind", "state"],
    )
    sent_by_kind: dict[str, int] = {}
    attempts_by_kind: dict[str, int] = {}
    for count in email_probe().counts:
        sent_by_kind.setdefault(count.kind, 0)
        attempts_by_kind[count.kind] = attempts_by_kind.get(count.kind, 0) + count.attempts
        if count.state == EmailDelivery.State.SENT:
            sent_by_kind[count.kind] = count.rows
        deliveries.add_metric([count.kind, count.state], count.rows)
    for name, n in sent_by_kind.items():
        sent.add_metric([name], n)
    for name, n in attempts_by_kind.items():
        attempts.add_metric([name], n)
    return [sent, attempts, deliveries]


@metrics_source("email_breaker", database=False)
def email_breaker_metrics() -> list[Metric]:
    return breaker_metrics(email_breaker_probe())
