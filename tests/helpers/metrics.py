"""Reading /metrics the way Prometheus does: the exposition parsed into samples; and the web
process as deployed for it, gunicorn's workers summed in one scrape."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST
from tests.helpers.processes import worker_env

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


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every series of the sample ``name``, by its labels."""
    return {labels: v for (sample, labels), v in samples.items() if sample == name}


@contextmanager
def multiprocess_gunicorn(directory: Path, *, log: Path, workers: int = 2) -> Iterator[str]:
    """gunicorn with ``workers`` workers in multiprocess mode (their counters in ``directory``,
    cleared at start), on this test's database and broker; yields its base URL."""
    with launch.gunicorn(
        worker_env(0, PROMETHEUS_MULTIPROC_DIR=str(directory)),
        args=("-c", "gunicorn.conf.py", "core.wsgi"),
        config=GunicornConfig(workers=workers),
        ready_path=METRICS_URL,
        ready_status=None,  # Django's answer, whatever it is: the application is loaded
        log=log,
    ) as server:
        yield f"http://{HOST}:{server.port}"
