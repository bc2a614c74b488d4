"""The chaos suite's ablation tool, without running the suite: each net's patch applies to this
revision and is recognised once applied, ``python -m chaos --without`` refuses a run whose
checkout does not match the nets it names, the goals that bound recovery and idle workers read
the committed result files as the issue's bar does, and ``python -m chaos.ablation --table``
renders those files' figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chaos import ablation, config
from chaos.faults import BOUNDED_FAULTS
from chaos.observe import net_actions
from chaos.report import recovery_over_bound
from stack.process import ROOT

pytestmark = pytest.mark.slow  # the chaos suite's tools, as test_chaos.py

RESULTS = ROOT / "chaos" / "results"
NETS = list(ablation.NETS.values())


def _chaos(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_every_net_has_its_patch_and_every_patch_a_net() -> None:
    assert sorted(p.name for p in ablation.PATCHES.glob("*.patch")) == sorted(
        f"{net.name}.patch" for net in NETS
    )
    assert len(NETS) == 4


@pytest.mark.parametrize("net", NETS, ids=lambda net: net.name)
def test_the_patch_applies_to_this_revision(net: ablation.Net) -> None:
    check = subprocess.run(
        ["git", "apply", "--check", str(net.patch)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("net", NETS, ids=lambda net: net.name)
def test_a_checkout_with_the_patch_applied_runs_only_with_that_net_named(
    net: ablation.Net, tmp_path: Path
) -> None:
    # The files every patch touches, as this revision has them, outside any repository.
    machinery = "packages/asyncwork/asyncwork"
    for name in (f"{machinery}/rescue.py", f"{machinery}/poll.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert ablation.patches_mismatch([], tmp_path) is None
    assert f"{net.name} is switched off by a patch" in str(
        ablation.patches_mismatch([net.name], tmp_path)
    )

    subprocess.run(["git", "apply", str(net.patch)], cwd=tmp_path, check=True)

    assert ablation.patches_mismatch([net.name], tmp_path) is None
    assert ablation.patches_mismatch([], tmp_path) == (
        f"{tmp_path} has {net.name}'s patch applied: add --without {net.name}"
    )


def test_without_a_net_the_checkout_or_broker_cannot_switch_off_is_refused(tmp_path: Path) -> None:
    run = _chaos("chaos", "--arm", "safe", "--without", "N2", "--results", str(tmp_path))
    assert run.returncode == 2
    assert "N2 is switched off by a patch, and chaos/ablation/N2.patch is not applied" in (
        run.stderr
    )
    run = _chaos(
        "chaos",
        *("--arm", "safe", "--broker", "rabbitmq", "--without", "N4"),
        *("--results", str(tmp_path)),
    )
    assert run.returncode == 2
    assert "--without N4: that net does not act on rabbitmq" in run.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--without", "N1"], "add --arm safe"),
        (["--without", "N1", "--arm", "safe"], "give --results DIR"),
        (["--without", "N9", "--arm", "safe"], "invalid choice: 'N9'"),
    ],
)
def test_an_ablation_run_that_could_mislead_is_refused(args: list[str], error: str) -> None:
    run = _chaos("chaos", *args)
    assert run.returncode == 2
    assert error in run.stderr


def test_the_ablation_refuses_an_unknown_net_and_the_committed_results() -> None:
    run = _chaos("chaos.ablation", "--results", "/tmp/x", "--nets", "N1,N7")
    assert run.returncode == 2
    assert "unknown net: N7" in run.stderr
    run = _chaos("chaos.ablation", "--results", str(RESULTS))
    assert run.returncode == 2
    assert "not chaos/results" in run.stderr
    first = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    run = _chaos("chaos.ablation", "--results", "/tmp/x", "--revision", first)
    assert run.returncode == 2
    assert "its chaos suite has no --without" in run.stderr


def _with_recoveries(name: str, seconds: list[float]) -> dict[str, Any]:
    """A committed result file whose safe arm's bounded faults took ``seconds``, in plan order
    (one the run skipped, as a kill that found no send to cut, made to have happened)."""
    document = json.loads((RESULTS / name).read_text())
    bounded = [f for f in document["arms"]["safe"]["faults"] if f["kind"] in BOUNDED_FAULTS]
    assert len(bounded) == len(seconds)
    for fault, value in zip(bounded, seconds, strict=True):
        fault.pop("skipped", None)
        fault["recovery_seconds"] = value
    return document


def test_recovery_over_30_s_names_each_fault_that_took_longer() -> None:
    bound = config.FULL.recovery_bound
    assert bound == 30
    seconds = [15, 11.1, 16.5, 30.5, 23.4, 15.8, 37.2, 12.1]
    faults = _with_recoveries("full.json", seconds)["arms"]["safe"]["faults"]
    over = recovery_over_bound(faults, bound)
    assert [(f["kind"], f["seconds"]) for f in over] == [
        ("redis_restart", 30.5),
        ("worker_kill", 37.2),
    ]


def test_net_actions_are_summed_from_the_processes_logs(tmp_path: Path) -> None:
    # Lines as the application's text formatter writes them (two workers' polls).
    (tmp_path / "worker1-1.log").write_text(
        "2026-12-02 10:00:01,000 INFO asyncwork.backend relay published 2 job(s) published=2\n"
        "2026-12-02 10:00:02,000 WARNING asyncwork.rescue rescue jobs: 3 job(s) of worker "
        "processes that are gone released and re-enqueued rescue=jobs rescued=3\n"
        "2026-12-02 10:00:03,000 WARNING asyncwork.recovery the broker lost its messages: 7 "
        "job(s) published and not started are published again republished=7\n"
        "2026-12-02 10:00:04,000 INFO asyncwork.backend relay published 9 job(s) published=9\n"
    )
    (tmp_path / "worker2-1.log").write_text(
        "2026-12-02 10:00:03,100 WARNING asyncwork.recovery the broker lost its messages: 0 "
        "job(s) published and not started are published again republished=0\n"
        "2026-12-02 10:00:05,000 WARNING asyncwork.rescue rescue jobs: 1 job(s) of worker "
        "processes that are gone released and re-enqueued rescue=jobs rescued=1\n"
    )
    actions = net_actions(tmp_path)
    assert actions.relayed == 11
    assert actions.rescued == {"jobs": 4}
    assert (actions.broker_losses, actions.republished) == (2, 7)


def test_the_table_shows_each_configuration_s_goals_and_recoveries(tmp_path: Path) -> None:
    redis_run = _with_recoveries("full.json", [15, 11.1, 16.5, 30.5, 23.4, 15.8, 37.2, 12.1])
    rabbitmq_run = _with_recoveries(
        "full-rabbitmq.json", [16.7, 15.4, 31.9, 25.5, 25.1, 16.3, 11, 11.8]
    )
    for configuration, broker, document in (
        ("baseline", "redis", redis_run),
        ("baseline", "rabbitmq", rabbitmq_run),
        ("N3", "redis", redis_run),
    ):
        (tmp_path / f"{configuration}-{broker}").mkdir()
        name = "full.json" if broker == "redis" else "full-rabbitmq.json"
        (tmp_path / f"{configuration}-{broker}" / name).write_text(json.dumps(document))
    (tmp_path / "N4-redis").mkdir()
    (tmp_path / "N4-redis" / "ablation.json").write_text('{"exit_code": 1}')
    (tmp_path / "not-a-run").mkdir()

    run = _chaos("chaos.ablation", "--results", str(tmp_path), "--table")

    assert run.returncode == 0, run.stderr
    redis, rabbitmq = run.stdout.split("### rabbitmq")
    rows = [line for line in redis.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| configuration",
        "| baseline",
        "| N3",
        "| N4",
    ]
    assert "| 15 11.1 16.5 15.8 **37.2** 12.1 | " in rows[1]
    assert " | **30.5** | 23.4 | " in rows[1]
    assert "no result (exit 1)" in rows[3]
    assert "| 16.7 15.4 **31.9** 16.3 11 11.8 | " in rabbitmq
    assert " | 25.5 | 25.1 | " in rabbitmq
    assert f"revision {rabbitmq_run['revision'][:12]}" in rabbitmq


def test_a_runs_processes_import_the_machinery_of_their_own_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worktree's patch to the machinery reaches the run: its processes import
    ``packages/asyncwork`` of the checkout they run from, not the one the virtualenv installed."""
    machinery = tmp_path / "packages" / "asyncwork" / "asyncwork"
    machinery.mkdir(parents=True)
    (machinery / "__init__.py").write_text("CHECKOUT = 'worktree'\n")
    monkeypatch.setattr(config, "ROOT", tmp_path)
    env = config.app_env(smtp_port=2525)
    result = subprocess.run(
        [sys.executable, "-c", "import asyncwork; print(asyncwork.CHECKOUT)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "worktree"
