"""The machinery's scrape-time gauges that the alert rules (deploy/prometheus/alerts.yml) need and
no other figure gives: the beat leader, and worker processes by heartbeat; read from real
PostgreSQL state (an advisory lock held on a session of its own, heartbeat rows written by a real
heartbeat thread) through GET /metrics."""

from __future__ import annotations

import pytest
from django.test import Client

from asyncwork.contrib.periodic.beat import LeaderLock
from tests.helpers.metrics import scrape, value
from tests.helpers.processes import a_lapsed_and_a_live_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_beat_leader_is_1_while_a_beat_holds_the_leader_lock(client: Client) -> None:
    assert value(scrape(client), "invoicing_beat_leader") == 0
    lock = LeaderLock()  # what a beat process takes, on a PostgreSQL session of its own
    try:
        assert lock.held()
        held = scrape(client)
    finally:
        lock.release()
    released = scrape(client)

    assert ("invoicing_beat_leader", ()) in held
    assert value(held, "invoicing_beat_leader") == 1
    assert value(released, "invoicing_beat_leader") == 0
    assert value(released, "invoicing_metrics_source_up", source="beat") == 1


def test_worker_processes_are_counted_live_and_lapsed_by_heartbeat(client: Client) -> None:
    empty = scrape(client)
    # Both series even with no row at all: "no live worker" is a 0, not a missing series.
    assert ("invoicing_worker_processes", (("state", "live"),)) in empty
    assert value(empty, "invoicing_worker_processes", state="live") == 0
    assert ("invoicing_worker_processes", (("state", "lapsed"),)) in empty
    assert value(empty, "invoicing_worker_processes", state="lapsed") == 0

    with a_lapsed_and_a_live_worker():
        samples = scrape(client)
    stopped = scrape(client)  # a clean stop deletes the row

    assert value(samples, "invoicing_worker_processes", state="live") == 1
    assert value(samples, "invoicing_worker_processes", state="lapsed") == 1
    assert value(stopped, "invoicing_worker_processes", state="live") == 0
    assert value(stopped, "invoicing_worker_processes", state="lapsed") == 1
    assert value(stopped, "invoicing_metrics_source_up", source="workers") == 1
