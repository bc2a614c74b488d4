"""The peers benchmark (``bench/peers.py``) end to end at a tiny size: every arm (asyncwork on
Redis and on RabbitMQ, django-tasks-db, procrastinate, django-tasks-fennel, the tutorial) runs
its tasks through its real workers, PostgreSQL, brokers and SMTP server, and asyncwork loses no
task to a worker's ``kill -9`` (it may run one twice: at least once). The run makes and removes
its own database, Redis keys and RabbitMQ virtual host."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from bench import peers
from stack.process import ROOT

pytestmark = pytest.mark.slow


def _vhosts() -> set[str]:
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_vhosts"], capture_output=True, text=True, check=True
    )
    return set(listed.stdout.split())


@pytest.mark.timeout(1500)
def test_every_arm_completes_and_asyncwork_loses_no_task_to_a_kill(tmp_path: Path) -> None:
    database = f"test_bench_peers_{secrets.token_hex(4)}"
    output = tmp_path / "peers.json"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    run = subprocess.Popen(
        [
            *(sys.executable, "-m", "bench.peers", "--tasks", "50", "--emails", "20"),
            *("--rounds", "1", "--latency-seconds", "2", "--kill-seconds", "3"),
            *("--output", str(output)),
            *("--database-url", f"postgres://postgres@127.0.0.1:5432/{database}"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        printed, _ = run.communicate(timeout=1400)
    finally:
        if run.poll() is None:
            # SIGTERM unwinds the benchmark: its workers, database and virtual host removed.
            run.terminate()
            run.communicate(timeout=120)
    assert run.returncode == 0, printed[-4000:]
    results = json.loads(output.read_text())
    assert set(results["arms"]) == set(peers.ARM_NAMES)
    for name, arm in results["arms"].items():
        assert arm["completed"], name
        assert arm["drain_rate"] > 0, name
        assert arm["email_rate"] > 0, name
    # At least once: a task whose run the kill cut short after its body may run again.
    for name in ("asyncwork-redis", "asyncwork-rabbitmq"):
        assert results["arms"][name]["lost"] == 0
    assert results["emails_received"] >= 20 * len(peers.ARM_NAMES)
    with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres") as db:
        left = db.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchall()
    assert not left, "the run's database was not dropped"
    run_id = re.search(r"Redis key\(s\) under (bench-[0-9a-f]+)", printed)
    assert run_id is not None, printed[-2000:]
    assert f"{run_id.group(1)}-peers" not in _vhosts(), "the run's virtual host was not deleted"
