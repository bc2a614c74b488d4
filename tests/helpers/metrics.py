"""Reading /metrics the way Prometheus does: the exposition parsed into samples."""

from __future__ import annotations

from typing import Any

from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

METRICS_URL = "/metrics"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(client: Client, **extra: Any) -> Samples:
    response = client.get(METRICS_URL, **extra)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return parse(response.content.decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a labelled counter series not yet created."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
