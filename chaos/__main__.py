"""Run the chaos suite (both arms by default) and report: ``python -m chaos``.

Writes ``<results>/<arm>.json`` and ``<results>/<arm>.txt`` (the human summary, also printed),
the processes' logs under ``<results>/logs/<arm>/``, and the run's result file
``<results>/<profile>.json`` (date, machine, every arm's report), kept in the repository and
rendered into docs/explanation/chaos.md by ``python -m scripts.docs_tables``. Exits non-zero
if the safe arm misses a goal, or if the control arm shows no loss (then the suite could not see
one).
``--without NET`` switches a safety net off in the safe arm (``chaos.ablation``).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from chaos import ablation, config, report, scale
from chaos.run import run_arm
from chaos.stack import BROKERS, REDIS
from stack import netns
from stack.process import ROOT

RESULTS = Path(__file__).resolve().parent / "results"


def _terminate(signum: int, frame: FrameType | None) -> None:
    # SIGINT (even when inherited as ignored, as in a background job), SIGTERM and SIGHUP
    # unwind like Ctrl-C, so every process and directory is cleaned up.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=["safe", "control", "both"], default="both")
    parser.add_argument("--profile", choices=sorted(config.PROFILES), default=config.FULL.name)
    parser.add_argument(
        "--short", action="store_true", help="the CI profile (--profile short: 200 invoices)"
    )
    parser.add_argument("--invoices", type=int, default=None, help="invoices per arm")
    parser.add_argument(
        "--control-invoices",
        type=int,
        default=None,
        help="invoices in the control arm (default: --invoices, or the profile's)",
    )
    parser.add_argument(
        "--broker",
        choices=BROKERS,
        default=REDIS,
        help="Celery's broker: redis, or a RabbitMQ node of the run's own (Redis stays for "
        "the cache); the restart fault restarts the broker's node",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="each role on a host of its own (network namespaces; needs root), with network "
        "partitions for faults: --profile hosts, or hosts-short with --short; with --broker "
        "rabbitmq the node is on the data host, and the cuts from the broker are from it",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="with --hosts: no faults; webhooks/s, emails/s and the stack's CPU per invoice "
        "with 1-3 worker hosts and 1-2 web hosts (--invoices per row, default 300)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--without",
        action="append",
        choices=list(ablation.NETS),
        default=[],
        metavar="NET",
        help="a safety net switched off, for an ablation (repeatable; safe arm, its own "
        f"--results): {', '.join(f'{n.name} {n.title}' for n in ablation.NETS.values())}. "
        "A net switched off by a patch needs it applied to this checkout: python -m "
        "chaos.ablation does that in a throwaway worktree",
    )
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)

    if args.scale and not args.hosts:
        parser.error("--scale measures across hosts: add --hosts")
    if args.scale and args.broker != REDIS:
        parser.error("--scale measures on Redis only (--broker redis)")
    if args.scale and args.without:
        parser.error("--scale measures without faults: --without means nothing there")
    if args.hosts:
        why_not = netns.available()
        if why_not:
            parser.error(f"--hosts: {why_not}")
        profile = config.HOSTS_SHORT if args.short else config.HOSTS
    else:
        profile = config.SHORT if args.short else config.PROFILES[args.profile]
    if args.scale:
        document = scale.run(
            results=args.results,
            invoices=args.invoices or 300,
            seed=args.seed if args.seed is not None else secrets.randbits(32),
        )
        print(scale.table(document))
        return 0
    if profile.hosts and not args.hosts:
        parser.error(f"--profile {profile.name} runs across hosts: add --hosts")
    without = tuple(dict.fromkeys(args.without))
    if without and args.arm != config.SAFE:
        parser.error("--without switches a safety net off in the safe arm: add --arm safe")
    if without and args.results.resolve() == RESULTS:
        parser.error(f"--without: give --results DIR (an ablated run must not replace {RESULTS})")
    for name in without:
        if args.broker not in ablation.NETS[name].brokers:
            parser.error(f"--without {name}: that net does not act on {args.broker}")
    mismatch = ablation.patches_mismatch(without, ROOT)
    if mismatch:
        parser.error(mismatch)
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    arms = [config.SAFE, config.CONTROL] if args.arm == "both" else [args.arm]
    failed = []
    reports = []
    started = time.time()
    for arm in arms:
        if arm == config.SAFE:
            invoices = args.invoices or profile.invoices
        else:
            invoices = args.control_invoices or args.invoices or profile.control_invoices
        print(
            f"chaos: {arm} arm, {invoices} invoices, seed {seed}, broker {args.broker} ...",
            flush=True,
        )
        log_dir = args.results / "logs" / arm
        # The report reads every worker log in it: an earlier run's would count as this one's.
        shutil.rmtree(log_dir, ignore_errors=True)
        result = run_arm(
            arm=arm,
            profile=profile,
            invoices=invoices,
            seed=seed,
            log_dir=log_dir,
            broker=args.broker,
            without=without,
        )
        path = report.write(result, args.results)
        reports.append(result)
        print(report.summary(result), flush=True)
        print(f"report: {path}\n", flush=True)
        if not result["passed"]:
            failed.append(arm)
    path = report.profile_write(
        reports, args.results, profile=profile.name, started=started, broker=args.broker
    )
    print(f"result file: {path}", flush=True)
    if failed:
        print(f"chaos: goals missed in the {' and '.join(failed)} arm(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
