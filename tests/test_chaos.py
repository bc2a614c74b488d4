"""The chaos suite's CI profile, run as a user would run it, and judged on its JSON report.

``python -m chaos --short`` runs both arms against PostgreSQL and Redis instances of its own
(200 invoices in each arm; one worker SIGKILLed inside the crash window, one 10 s broker stall,
one Redis restart that drops every queued message); with
``--broker rabbitmq`` the broker is a RabbitMQ node of its own, stalled (SIGSTOP) and restarted
on its data instead, and only the safe arm runs here: on RabbitMQ the short profile's one kill
is the control arm's only way to lose (the restart loses nothing there), too few for a loss
every time; the full profile's control arm on RabbitMQ is in docs/explanation/chaos.md. The
safe arm must lose nothing, dead-letter only permanent refusals, and duplicate at most the
sends the kill cut inside the crash window, under one Message-ID; the control arm, with
at-least-once switched off (early acknowledgement, and workers whose poll only relays: no rescue,
no republish of what the broker lost), must lose something, or the suite could not see a loss at
all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stack.process import ROOT

pytestmark = pytest.mark.slow


def _report(results: Path, arm: str, output: str) -> dict[str, Any]:
    path = results / f"{arm}.json"
    assert path.exists(), output  # the run failed before it could report
    return json.loads(path.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("broker", "arms", "restart"),
    [("redis", "both", "redis_restart"), ("rabbitmq", "safe", "rabbitmq_restart")],
)
def test_short_chaos_run_loses_nothing_and_its_control_arm_does(
    tmp_path: Path, broker: str, arms: str, restart: str
) -> None:
    # The environment a user's shell would have: none of the test run's settings.
    env = {k: v for k, v in os.environ.items() if k in {"PATH", "HOME", "LANG"}}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos",
            "--short",
            "--broker",
            broker,
            "--arm",
            arms,
            "--results",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    output = run.stdout + run.stderr
    safe = _report(tmp_path, "safe", output)

    results = safe["results"]
    assert results["invoices_paid"] == 200, output
    assert results["lost"] == 0, output
    assert results["acknowledged_not_stored"] == [], output
    assert results["dead_letters"]["refused_without_dead_letter"] == [], output
    refused = results["invoices_paid_refused_recipient"]
    assert results["dead_letters"]["permanent_refusals"] >= refused > 0, output
    assert results["dead_letters"]["all_permanent_refusals"], output
    duplicates, kills = results["duplicates"], results["kills"]
    assert kills["worker_kills"] == 1, output
    assert duplicates["extra_messages"] <= kills["sends_cut_in_window_by_kills"], output
    assert duplicates["all_same_message_id"], output
    assert results["marked_sent_not_delivered"] == [], output
    assert safe["broker"] == broker
    assert {f["kind"] for f in safe["faults"]} == {"worker_kill", "broker_stall", restart}
    assert results["every_fault_recovered"], output
    # The workers' poll did the repairs: the killed worker's job given back, and on Redis the
    # restart seen and what it dropped published again.
    nets = results["safety_net_actions"]
    assert nets["rescued"].get("jobs", 0) >= 1, output
    if broker == "redis":
        (dropped,) = [f["queued_messages_dropped"] for f in safe["faults"] if f["kind"] == restart]
        assert nets["broker_losses"] >= 1, output
        assert nets["republished"] >= (1 if dropped else 0), output
    assert safe["load"]["duplicate_share"] >= 0.3
    assert safe["load"]["senders"] >= 16
    assert safe["passed"], output

    if arms == "both":
        control = _report(tmp_path, "control", output)
        assert control["broker"] == broker
        assert control["results"]["lost"] > 0, output
        assert control["passed"], output
    assert run.returncode == 0, output
