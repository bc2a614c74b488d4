"""Run a chaos profile (the full one by default) with every safety net, then with each net
switched off in turn, the safe arm only and one seed, and print which goals each
configuration missed: ``python -m chaos.ablation --results DIR``.

Every configuration runs from a throwaway git worktree of one revision (``--revision``,
HEAD by default: uncommitted changes are not in it), with the net's patch applied there, as
``python -m chaos --arm safe [--without NET]``. Each run gets its own directory in
``--results``, ``<configuration>-<broker>`` (``.2``, ``.3`` ... when that configuration already
ran there): the run's result file, its output (``chaos.out``), its logs, and ``ablation.json``
(what ran, from which revision, its exit code). The table is read from every such directory
in ``--results``, printed and written to ``table.md``; ``--table`` prints it without running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from chaos import config
from chaos.ablation import NETS, SEED
from chaos.report import STALL_GAP, over_bound, recovery_goal, utc
from chaos.stack import BROKERS
from stack.process import ROOT, Process

BASELINE = "baseline"
CONFIGURATIONS = (BASELINE, *NETS)
_RUN_DIR = re.compile(rf"^(?P<configuration>.+)-(?P<broker>{'|'.join(BROKERS)})(?:\.(?P<n>\d+))?$")

GOAL_LABELS = {
    "lost_zero": "lost 0",
    "refused_recipients_dead_lettered": "refused dead-lettered",
    "dead_letters_all_permanent_refusals": "dead letters permanent",
    "duplicates_within_sends_cut_by_kills": "duplicates <= cut",
    "duplicates_share_message_id": "one Message-ID",
    "nothing_marked_sent_undelivered": "no sent undelivered",
    "relay_kills_landed": "relay kills landed",
    **{
        recovery_goal(p.recovery_bound): f"recovery <= {p.recovery_bound:g} s"
        for p in config.PROFILES.values()
        if p.recovery_bound is not None
    },
    "no_worker_stalled_with_work_waiting": f"no idle > {STALL_GAP:g} s",
}
FAULT_LABELS = {
    "worker_kill": "worker kills, s",
    "relay_kill": "relay kills, s",
    "redis_restart": "broker restart, s",
    "rabbitmq_restart": "broker restart, s",
    "postgres_restart": "PostgreSQL restart, s",
    "broker_stall": "broker stall, s",
}


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(  # noqa: S603 - our own argv, no shell
        ["git", *args],  # noqa: S607 - git on PATH
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@contextlib.contextmanager
def worktree(revision: str, patch: str | None) -> Iterator[Path]:
    """A throwaway worktree of ``revision`` with its own copy of the patch ``patch``
    (``chaos/ablation/<net>.patch``) applied; removed afterwards, on an error too."""
    parent = Path(tempfile.mkdtemp(prefix="chaos-ablation-"))
    tree = parent / "tree"
    try:
        _git("worktree", "add", "--detach", "--quiet", str(tree), revision)
        if patch is not None:
            _git("apply", patch, cwd=tree)
        yield tree
    finally:
        if tree.exists():
            _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(parent, ignore_errors=True)


def _run_dir(results: Path, configuration: str, broker: str) -> Path:
    """The next unused directory for this configuration on this broker."""
    base = f"{configuration}-{broker}"
    n = 1
    while (results / (base if n == 1 else f"{base}.{n}")).exists():
        n += 1
    return results / (base if n == 1 else f"{base}.{n}")


def run_one(
    *,
    configuration: str,
    broker: str,
    profile: config.Profile,
    seed: int,
    revision: str,
    results: Path,
) -> dict[str, Any]:
    """One safe arm of ``profile``, ``configuration``'s net switched off, from a throwaway
    worktree of ``revision``; returns (and writes) its ``ablation.json``."""
    net = NETS.get(configuration)
    out = _run_dir(results, configuration, broker)
    out.mkdir(parents=True)
    argv = [
        "-m",
        "chaos",
        "--arm",
        config.SAFE,
        # Across hosts, chaos picks the profile from --short.
        *(
            ["--hosts", *(["--short"] if profile is config.HOSTS_SHORT else [])]
            if profile.hosts
            else ["--profile", profile.name]
        ),
        "--broker",
        broker,
        "--seed",
        str(seed),
        "--results",
        str(out),
        *(["--without", net.name] if net else []),
    ]
    patch = f"chaos/ablation/{net.name}.patch" if net else None
    started = time.time()
    with worktree(revision, patch) as tree:
        # A process group of its own (stack.process): Ctrl-C reaches this process only, which
        # then stops the run once, in order.
        child = Process(
            [sys.executable, *argv],
            name="chaos",
            env=os.environ,
            log=out / "chaos.out",
            cwd=tree,
        )
        try:
            code = child.popen.wait()
        except KeyboardInterrupt:
            child.stop(grace=120)
            raise
    record = {
        "configuration": configuration,
        "net": net.title if net else "every safety net on",
        "patch": patch,
        "broker": broker,
        "profile": profile.name,
        "seed": seed,
        "revision": revision,
        "command": "python " + " ".join(argv),
        "exit_code": code,
        "started_at": utc(started),
        "seconds": round(time.time() - started, 1),
    }
    (out / "ablation.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


@dataclass(frozen=True)
class Run:
    configuration: str
    broker: str
    n: int
    directory: Path
    record: dict[str, Any]
    arm: dict[str, Any] | None  # the safe arm's report, without its timeline


def runs_in(results: Path) -> list[Run]:
    """Every run in ``results``, by broker, configuration (baseline first, then the nets in
    order) and repetition."""
    found = []
    for directory in sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []:
        match = _RUN_DIR.match(directory.name)
        if match is None or match["configuration"] not in CONFIGURATIONS:
            continue
        record_file = directory / "ablation.json"
        record = json.loads(record_file.read_text()) if record_file.exists() else {}
        arm = None
        for path in directory.glob("*.json"):
            document = json.loads(path.read_text())
            if isinstance(document, dict) and config.SAFE in document.get("arms", {}):
                arm = document["arms"][config.SAFE]
                record.setdefault("revision", document.get("revision"))
        found.append(
            Run(
                configuration=match["configuration"],
                broker=match["broker"],
                n=int(match["n"] or 1),
                directory=directory,
                record=record,
                arm=arm,
            )
        )
    return sorted(
        found, key=lambda r: (BROKERS.index(r.broker), CONFIGURATIONS.index(r.configuration), r.n)
    )


def _seconds(fault: dict[str, Any], bound: float | None) -> str:
    if "skipped" in fault:
        return "skipped"
    seconds = fault.get("recovery_seconds")
    if seconds is None:
        return "**never**"
    return f"**{seconds:g}**" if over_bound(fault, bound) else f"{seconds:g}"


def _nets_acted(actions: dict[str, Any] | None) -> str:
    """What the nets did: the jobs the rescue gave back (N1-N3 log as one), and the jobs
    published again after the broker lost them (N4), with how often that was seen."""
    if actions is None or "republished" not in actions:  # a run of a suite that did not log them
        return "-"
    rescued = actions["rescued"].get("jobs", 0)
    return f"N1-N3 {rescued} · N4 {actions['republished']} ({actions['broker_losses']} losses seen)"


def _stalls(stalls: list[dict[str, Any]]) -> str:
    if not stalls:
        return "none"
    return f"**{len(stalls)}, longest {max(s['seconds'] for s in stalls):g} s**"


def _label(run: Run) -> str:
    return run.configuration + (f" ({run.n})" if run.n > 1 else "")


def table(runs: list[Run]) -> str:
    """One Markdown table per broker: configuration x goals, each fault's recovery (seconds,
    in the plan's order), the workers idle with emails waiting, and what each net did."""
    lines: list[str] = []
    for broker in BROKERS:
        of_broker = [r for r in runs if r.broker == broker]
        if not of_broker:
            continue
        arms = [r.arm for r in of_broker if r.arm is not None]
        goals = list(dict.fromkeys(g for arm in arms for g in arm["goals"]))
        kinds = list(dict.fromkeys(f["kind"] for arm in arms for f in arm["faults"]))
        header = [
            "configuration",
            *(GOAL_LABELS.get(g, g) for g in goals),
            "lost",
            *(FAULT_LABELS.get(k, k) for k in kinds),
            "idle with work waiting",
            "nets acted",
            "arm, s",
        ]
        revisions = sorted(
            {r.record["revision"][:12] for r in of_broker if r.record.get("revision")}
        )
        seeds = sorted({str(r.arm["seed"]) for r in of_broker if r.arm is not None})
        profiles = sorted({r.arm["profile"] for r in of_broker if r.arm is not None})
        lines += [
            f"### {broker}: profile {', '.join(profiles) or '?'}, seed {', '.join(seeds) or '?'}, "
            f"revision {', '.join(revisions) or '?'}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for run in of_broker:
            if run.arm is None:
                code = run.record.get("exit_code", "?")
                cells = [f"no result (exit {code}): {run.directory / 'chaos.out'}"]
                cells += [""] * (len(header) - 2)
            else:
                arm, results = run.arm, run.arm["results"]
                bound = config.PROFILES[arm["profile"]].recovery_bound
                cells = [
                    *(
                        "-"
                        if g not in arm["goals"]
                        else ("pass" if arm["goals"][g] else "**MISS**")
                        for g in goals
                    ),
                    str(results["lost"]),
                    *(
                        " ".join(_seconds(f, bound) for f in arm["faults"] if f["kind"] == kind)
                        or "-"
                        for kind in kinds
                    ),
                    _stalls(results["workers_stalled_with_work_waiting"]),
                    _nets_acted(results.get("safety_net_actions")),
                    f"{arm['duration_seconds']:g}",
                ]
            lines.append("| " + " | ".join([_label(run), *cells]) + " |")
        lines.append("")
    lines += [
        "Recovery in seconds, each fault in the plan's order; bold: over the profile's bound "
        f"({config.FULL.name}: {config.FULL.recovery_bound:g} s, for worker kills, broker and "
        "PostgreSQL restarts) or never. Nets acted, from the workers' logs: N1-N3 the jobs the "
        "workers' rescue gave back (by lease, by heartbeat, held by a dead consumer: logged "
        "together), N4 the jobs published again after the broker lost its messages (and how "
        "often a worker saw that).",
        "Configurations: " + "; ".join(f"{n.name} off = {n.title}" for n in NETS.values()) + ".",
    ]
    return "\n".join(lines)


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: {', '.join(unknown) or 'none given'}; choose from {', '.join(allowed)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.ablation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--results", type=Path, required=True, help="where every run goes")
    parser.add_argument(
        "--broker",
        type=lambda t: _names(t, BROKERS, "unknown broker"),
        default=list(BROKERS),
        help=f"comma-separated, default {','.join(BROKERS)}",
    )
    parser.add_argument(
        "--nets",
        type=lambda t: _names(t, tuple(NETS), "unknown net"),
        default=list(NETS),
        help=f"the nets switched off, one run each, comma-separated; default all: {','.join(NETS)}",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the run with every net")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--profile", choices=sorted(config.PROFILES), default=config.FULL.name)
    parser.add_argument("--short", action="store_true", help="the CI profile (--profile short)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED}")
    parser.add_argument("--revision", default="HEAD", help="the commit every run is made from")
    parser.add_argument(
        "--table", action="store_true", help="print the table of the runs in --results, run nothing"
    )
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    if args.table:
        print(table(runs_in(args.results)))
        return 0
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    if args.results.resolve() == (ROOT / "chaos" / "results").resolve():
        parser.error("--results: a directory of its own, not chaos/results")
    profile = config.SHORT if args.short else config.PROFILES[args.profile]
    try:
        revision = _git("rev-parse", "--verify", f"{args.revision}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"--revision {args.revision}: not a commit of {ROOT}")
    try:
        _git("cat-file", "-e", f"{revision}:chaos/ablation/__init__.py")
    except subprocess.CalledProcessError:
        parser.error(
            f"--revision {args.revision}: its chaos suite has no --without (chaos.ablation)"
        )
    if args.revision == "HEAD" and _git("status", "--porcelain", "--untracked-files=no"):
        print(f"ablation: runs {revision[:12]}; the uncommitted changes in {ROOT} are not in it")
    plan = [
        (configuration, broker)
        for broker in args.broker
        for configuration in ([] if args.no_baseline else [BASELINE]) + args.nets
        if configuration == BASELINE or broker in NETS[configuration].brokers
        for _ in range(args.repeat)
    ]
    skipped = [f"{n} on {b}" for b in args.broker for n in args.nets if b not in NETS[n].brokers]
    if skipped:
        print(f"ablation: not run, the net does not act there: {', '.join(skipped)}")
    args.results.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for i, (configuration, broker) in enumerate(plan, 1):
        print(
            f"ablation: run {i}/{len(plan)}: {configuration} on {broker} "
            f"({profile.name} profile, safe arm, seed {args.seed}) ...",
            flush=True,
        )
        record = run_one(
            configuration=configuration,
            broker=broker,
            profile=profile,
            seed=args.seed,
            revision=revision,
            results=args.results,
        )
        print(
            f"ablation: {configuration} on {broker}: exit {record['exit_code']} in "
            f"{record['seconds']:g} s ({(time.monotonic() - began) / 60:.1f} min so far)",
            flush=True,
        )
    runs = runs_in(args.results)
    text = table(runs)
    (args.results / "table.md").write_text(text + "\n")
    print(text)
    # A configuration that missed a goal is a finding; one that left no result is not.
    return 1 if any(run.arm is None for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
