"""The README's first command: the demo runs the whole flow and ends as it says, on a database
of its own.

The demo runs on a database of this test's own (named in DATABASE_URL: it creates it, as on a
fresh machine; the test drops it) and on a Redis database nothing else here uses, under key
prefixes of its own: a developer's ``invoicing`` or ``invoicing_demo`` database, a local stack
or another test run on the same machine sees nothing of it. A database of that name the demo
did not create is refused untouched."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from stack.net import free_port
from stack.process import ROOT

pytestmark = pytest.mark.slow


POSTGRES = "postgres://postgres@127.0.0.1:5432"
# The Redis database no other test uses; the demo's keys carry its run's prefix.
OWN_REDIS = {
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/13",
    "REDIS_URL": "redis://127.0.0.1:6379/13",
}


def demo_process(**settings: str) -> subprocess.CompletedProcess[str]:
    """The demo run as a user's shell would run it: none of the test run's settings, plus
    ``settings``."""
    env = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG", "TMPDIR"}}
    return subprocess.run(
        [sys.executable, "scripts/demo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**env, **settings},
    )


def run_demo(**settings: str) -> tuple[str, float]:
    """Run the demo (``demo_process``); return its output and how long it took, failing if it
    failed."""
    started = time.monotonic()
    result = demo_process(**settings)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, elapsed


def database_comment(name: str) -> str | None:
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
        found = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
            [name],
        ).fetchone()
    assert found is not None, f"no database {name}"
    return found[0]


def table_count(name: str) -> int:
    with psycopg.connect(f"{POSTGRES}/{name}") as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone()
    assert found is not None
    return int(found[0])


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
    yield f"{POSTGRES}/{name}"
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
        conn.execute(drop.format(sql.Identifier(name)))


def test_demo_runs_the_whole_flow_in_under_a_minute_on_a_database_of_its_own(
    own_database: str,
) -> None:
    name = own_database.rsplit("/", 1)[1]
    out, elapsed = run_demo(DATABASE_URL=own_database, **OWN_REDIS)
    assert f"created database {name}" in out
    assert_whole_flow(out)
    assert "does not answer" not in out
    assert elapsed < 60
    # Where it wrote, and how to drop it: its last line.
    assert out.splitlines()[-1] == (
        f"demo database: {name}; to drop it: dropdb -h 127.0.0.1 -U postgres {name}"
    )
    assert database_comment(name) == "created by the invoice demo (scripts/demo.py)"

    again, _ = run_demo(DATABASE_URL=own_database, **OWN_REDIS)  # its own: used again
    assert "created database" not in again
    assert_whole_flow(again)


def test_demo_refuses_a_database_it_did_not_create_and_leaves_it_untouched(
    own_database: str,
) -> None:
    name = own_database.rsplit("/", 1)[1]
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    refused = demo_process(DATABASE_URL=own_database, **OWN_REDIS)
    assert refused.returncode == 1
    assert (refused.stdout, refused.stderr.splitlines()) == (
        "",
        [
            f"demo: database {name} exists and was not created by the demo: it is left alone "
            "(unset DATABASE_URL for the demo's own, invoicing_demo, or name another in "
            "DATABASE_URL)"
        ],
    )
    assert (database_comment(name), table_count(name)) == (None, 0)


def test_without_database_url_the_demo_writes_to_invoicing_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from the script (a run would write to this machine's invoicing_demo)."""
    monkeypatch.setenv("DEMO_LOGS", str(tmp_path))  # the script makes a directory otherwise
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    assert spec is not None
    assert spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.database_url({}) == f"{POSTGRES}/invoicing_demo"
    assert demo.database_url({"DATABASE_URL": f"{POSTGRES}/x"}) == f"{POSTGRES}/x"


def test_demo_falls_back_to_embedded_services_when_neither_answers() -> None:
    port = free_port()  # nothing listens there
    out, elapsed = run_demo(
        DATABASE_URL=f"postgres://postgres@127.0.0.1:{port}/invoicing_demo",
        REDIS_URL=f"redis://127.0.0.1:{port}/1",
        CELERY_BROKER_URL=f"redis://127.0.0.1:{port}/0",
    )
    assert f"PostgreSQL does not answer at 127.0.0.1:{port}." in out
    assert "Using an embedded PostgreSQL (pgserver)" in out
    assert (
        f"Redis does not answer at redis://127.0.0.1:{port}/0, redis://127.0.0.1:{port}/1." in out
    )
    assert "Using an embedded Redis-protocol server (fakeredis)" in out
    assert "created database invoicing_demo" in out  # a fresh, embedded server
    assert_whole_flow(out)  # beat's leader lock included: it is on the embedded server
    assert elapsed < 60
    assert out.splitlines()[-1] == (
        "demo database: invoicing_demo on an embedded PostgreSQL, deleted as the demo ends"
    )
