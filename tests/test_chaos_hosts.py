"""The chaos suite across hosts: how it reads the beats' logs (a slot two beats dispatched, the
standby's takeover, the old leader's dispatches after it), and its options refused with a
clear message. The run itself (``python -m chaos --hosts --short``, several minutes, root)
is in docs/explanation/chaos.md with its result file, not in CI."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from chaos.hosts import BEAT_HOST_CUT, beat_analysis
from stack.process import ROOT

pytestmark = pytest.mark.slow  # the chaos suite's tools, as test_chaos.py


def _stamp(moment: float) -> str:
    return datetime.fromtimestamp(moment).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def _log(path: Path, lines: list[tuple[float, str]]) -> None:
    path.write_text(
        "".join(f"{_stamp(at)} INFO celery.beat {text}\n" for at, text in lines)
        + "some other line\n"
    )


def test_beat_analysis_finds_the_takeover_and_what_the_old_leader_did_after_it(
    tmp_path: Path,
) -> None:
    t = 1_800_000_000.0
    took = "beat took the leader lock: dispatching"
    alert = "Scheduler: Sending due task dlq-alert (dlq-alert)"
    _log(tmp_path / "beat-beat1.log", [(t, took), (t + 5, alert), (t + 10, alert), (t + 41, alert)])
    _log(tmp_path / "beat-beat2.log", [(t + 30, took), (t + 31, alert), (t + 36, alert)])
    cut = {
        "kind": BEAT_HOST_CUT,
        "host": "beat1",
        "standby": "beat2",
        "at": t + 12,
        "ended": t + 40,
    }

    found = beat_analysis([cut], tmp_path, {"dlq-alert": 5}, started=t)

    assert found["dispatches"] == {"beat-beat1": 3, "beat-beat2": 2}
    [summary] = found["beat_host_cuts"]
    assert summary["standby_took_over_after_seconds"] == 18.0
    # beat1's dispatch at +41 s came after the heal and after beat2 led: not fenced.
    assert summary["old_leader_dispatches_after_takeover"] == 1
    assert summary["old_leader_dispatches_after_heal"] == 1
    # +36 (beat2) and +41 (beat1) are one slot of a 5 s task apart, not half of one: no double;
    # a dispatch by beat1 at +31.5 would be.
    assert found["slots_dispatched_twice"] == []
    _log(tmp_path / "beat-beat1.log", [(t, took), (t + 31.5, alert)])
    doubled = beat_analysis([cut], tmp_path, {"dlq-alert": 5}, started=t)
    assert doubled["slots_dispatched_twice"] == [
        {"task": "dlq-alert", "at": 31.0, "beats": ["beat-beat2", "beat-beat1"]}
    ]


def test_hosts_options_are_refused_with_a_message() -> None:
    for argv, message in (
        (["--scale"], "--scale measures across hosts: add --hosts"),
        (["--hosts", "--scale", "--broker", "rabbitmq"], "--scale measures on Redis only"),
        (["--profile", "hosts-short"], "runs across hosts: add --hosts"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "chaos", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2
        assert message in done.stderr
        assert "Traceback" not in done.stderr
