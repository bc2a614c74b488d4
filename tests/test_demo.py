"""The README's first command: the demo runs the whole flow and ends as it says.

The demo runs on a database of this test's own (it creates it, as on a fresh machine; the
test drops it) and on a Redis database nothing else here uses, under key prefixes of its own:
a developer's ``invoicing`` database, a local stack or another test run on the same machine
sees nothing of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from stack.net import free_port
from stack.process import ROOT

pytestmark = pytest.mark.slow


def run_demo(**settings: str) -> tuple[str, float]:
    """Run the demo as a user's shell would (none of the test run's settings, plus ``settings``);
    return its output and how long it took, failing if it failed."""
    env = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG", "TMPDIR"}}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "scripts/demo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, **settings},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, elapsed


def assert_whole_flow(out: str) -> None:
    assert '"duplicate": false' in out
    assert '"duplicate": true' in out
    assert "emails received: 1" in out
    assert "recipient refused" in out
    assert "1 replayed, 0 skipped" in out
    assert (
        "== 2 emails received for 2 paid invoices (2 marked sent); dead letters waiting: 0" in out
    )
    assert "beat: dispatching scheduled jobs" in out
    assert "pipeline: OK" in out
    # gunicorn serves the admin's stylesheet itself, under its hashed name, cacheable for good.
    assert re.search(
        r"GET /static/admin/css/base\.[0-9a-f]{12}\.css -> 200, max-age=315360000, public, "
        r"immutable\n",
        out,
    ), out


@pytest.fixture
def own_database() -> Iterator[str]:
    """A DATABASE_URL naming a database that does not exist yet; dropped after the test."""
    name = f"demo_test_{uuid.uuid4().hex[:10]}"
    yield f"postgres://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
        conn.execute(drop.format(sql.Identifier(name)))


def test_demo_runs_the_whole_flow_in_under_a_minute(own_database: str) -> None:
    out, elapsed = run_demo(
        DATABASE_URL=own_database,
        # Redis database 13: one no other test uses; the demo's keys carry its run's prefix.
        CELERY_BROKER_URL="redis://127.0.0.1:6379/13",
        REDIS_URL="redis://127.0.0.1:6379/13",
    )
    assert f"created database {own_database.rsplit('/', 1)[1]}" in out
    assert_whole_flow(out)
    assert "does not answer" not in out
    assert elapsed < 60


def test_demo_falls_back_to_embedded_services_when_neither_answers() -> None:
    port = free_port()  # nothing listens there
    out, elapsed = run_demo(
        DATABASE_URL=f"postgres://postgres@127.0.0.1:{port}/invoicing",
        REDIS_URL=f"redis://127.0.0.1:{port}/1",
        CELERY_BROKER_URL=f"redis://127.0.0.1:{port}/0",
    )
    assert f"PostgreSQL does not answer at 127.0.0.1:{port}." in out
    assert "Using an embedded PostgreSQL (pgserver)" in out
    assert (
        f"Redis does not answer at redis://127.0.0.1:{port}/0, redis://127.0.0.1:{port}/1." in out
    )
    assert "Using an embedded Redis-protocol server (fakeredis)" in out
    assert "created database invoicing" in out  # a fresh, embedded server
    assert_whole_flow(out)  # beat's leader lock included: it is on the embedded server
    assert elapsed < 60
