"""Every benchmark in sequence, then one table of every goal: ``.venv/bin/python -m bench``.

Runs ``webhook_ingest`` (shorter than its own defaults), ``pipeline``, ``e2e_latency``,
``ack_latency``, ``ingest_load``, ``worker_rss`` and ``peers``, each as its own ``main()`` with
the profile's arguments and its usual JSON result under ``bench/results/``; then prints metric,
value, goal, ratio and PASS/MISS for every goal, with the date and the machine, and writes
``bench/results/summary.json``.

Profiles: ``full`` (default; about 15 minutes on 2 vCPUs, then ``peers``, whose 20,000-task
burn-downs on the database backends take the longest) and ``--quick`` (about 5, then about 10
for ``peers``). A missed goal is MISS, not a failure; the exit status is 1 when a benchmark
failed (a request or a check of the stored state, or another run holding the benchmark
database), 130 on Ctrl-C (the running benchmark stops everything it started, and the rest are
not run).

    .venv/bin/python -m bench [--quick] [--only pipeline,ack_latency]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import (
    ack_latency,
    e2e_latency,
    ingest_load,
    peers,
    pipeline,
    webhook_ingest,
    worker_rss,
)
from bench.report import Goal, machine, revision, table, utc
from bench.run import DATABASE_URL, REDIS_URL, RESULTS, ROOT, sigterm_as_interrupt

Main = Callable[[Sequence[str] | None], int]
BENCHMARKS: dict[str, Main] = {
    "webhook_ingest": webhook_ingest.main,
    "pipeline": pipeline.main,
    "e2e_latency": e2e_latency.main,
    "ack_latency": ack_latency.main,
    "ingest_load": ingest_load.main,
    "worker_rss": worker_rss.main,
    "peers": peers.main,
}
PROFILES: dict[str, dict[str, list[str]]] = {
    "full": {
        "webhook_ingest": ["--rounds", "3", "--duration", "5", "--warmup", "1"],
        "pipeline": ["--emails", "2000", "--rounds", "3"],
        "e2e_latency": ["--duration", "20", "--max-duration", "10"],
        "ack_latency": ["--duration", "20", "--rounds", "2"],
        "ingest_load": ["--max-duration", "10", "--duration", "20", "--throttle", "1.0,0.6"],
        "worker_rss": ["--emails", "10000", "--baseline", "1000"],
        "peers": [],
    },
    "quick": {
        "webhook_ingest": [
            *("--rounds", "1", "--duration", "3", "--warmup", "1", "--duplicates", "500"),
        ],
        "pipeline": ["--emails", "2000", "--rounds", "1"],
        "e2e_latency": ["--duration", "8", "--max-duration", "5"],
        "ack_latency": ["--duration", "8", "--rounds", "1"],
        "ingest_load": ["--max-duration", "5", "--duration", "8"],
        "worker_rss": ["--emails", "3000", "--baseline", "1000"],
        "peers": ["--quick"],
    },
}


def goals_of(document: dict[str, Any]) -> list[Goal]:
    """The goal rows a benchmark wrote into its result file."""
    return [Goal.from_dict(goal) for goal in document.get("summary", [])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short profile")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of {', '.join(BENCHMARKS)}"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "summary.json")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()] or list(BENCHMARKS)
    unknown = set(chosen) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    profile = "quick" if args.quick else "full"
    sigterm_as_interrupt()

    started = time.time()
    host = machine(postgres_url=DATABASE_URL, redis_url=REDIS_URL)
    runs: dict[str, dict[str, Any]] = {}
    goals: list[Goal] = []
    interrupted = False
    for name in chosen:
        output = RESULTS / f"{name}.json"
        arguments = [*PROFILES[profile][name], "--output", str(output)]
        print(f"\n=== {name} {' '.join(arguments)}", flush=True)
        begun = time.time()
        try:
            status = BENCHMARKS[name](arguments)
        except KeyboardInterrupt:
            status = 130
        except Exception as exc:  # one broken benchmark does not stop the others
            print(f"{name} crashed: {exc!r}", file=sys.stderr)
            status = 2
        seconds = time.time() - begun
        written = output.exists() and output.stat().st_mtime >= begun
        document = json.loads(output.read_text()) if written else None
        runs[name] = {
            "exit": status,
            "seconds": round(seconds, 1),
            "output": str(output.relative_to(ROOT)) if written else None,
            "checks_ok": (document or {}).get("checks", {}).get("ok"),
            "incidents": (document or {}).get("incidents", []),
        }
        if document is not None:
            goals += goals_of(document)
        if status == 130:
            interrupted = True
            break

    print()
    print(
        f"=== summary ({profile} profile), {utc(started)}, {time.time() - started:.0f} s; "
        f"{host['nproc']} CPUs ({host['cpu_model']}), {host['memory_gib']} GiB; "
        f"load average at start {host['loadavg_at_start'][0]}"
    )
    print(table(goals))
    print("(ratio: the compared ratio, or value ÷ limit for an absolute goal)")
    for name, run in runs.items():
        state = {0: "ok", 1: "FAILED", 130: "interrupted"}.get(run["exit"], "CRASHED")
        checks = {True: "stored state OK", False: "stored state WRONG", None: "no result"}
        incidents = f"; {len(run['incidents'])} incident(s)" if run["incidents"] else ""
        print(
            f"  {name:<15} {state:<11} {run['seconds']:>6.0f} s  "
            f"{checks[run['checks_ok']]}{incidents}"
        )
    document = {
        "started_at": utc(started),
        "finished_at": utc(time.time()),
        "profile": profile,
        "machine": host,
        "revision": revision(),
        "benchmarks": runs,
        "goals": [goal.as_dict() for goal in goals],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults: {args.output}")
    if interrupted:
        return 130
    return 0 if all(run["exit"] == 0 for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
