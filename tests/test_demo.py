"""The README's first command: the demo runs the whole flow and ends as it says."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_demo_runs_the_whole_flow_in_under_a_minute() -> None:
    started = time.monotonic()
    # The environment a user's shell would have: none of the test run's settings.
    env = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG", "TMPDIR"}}
    result = subprocess.run(
        [sys.executable, "scripts/demo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
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
    assert elapsed < 60
