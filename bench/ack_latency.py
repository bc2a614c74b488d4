"""Webhook acknowledgement latency with a slow SMTP server against an instant one.

The whole stack runs (gunicorn, Celery workers, an SMTP sink in this process) and new
``invoice.paid`` events are posted open-loop at a fixed, moderate rate for a fixed time, in two
arms interleaved over rounds:

* ``instant``: the sink answers every DATA at once, so the workers send emails while the
  webhook takes events;
* ``slow``: the sink answers every DATA after 5 s (awaited per session, like a slow provider:
  ``EMAIL_TIMEOUT``, 10 s by default, is longer), so every worker process is soon waiting on
  SMTP and the email queue grows.

A latency runs from when the request was due (open loop: a server that falls behind is charged
for it) to the end of the response. Goal: p99 with the slow server at most 1.2 x the
p99 with the instant one: the acknowledgement never waits on email. After each arm the sink is
made instant and the backlog drained, so the next arm starts from empty queues; at the end every
event must have produced exactly one email and no dead letter.

    .venv/bin/python -m bench.ack_latency [--rate 25 --duration 20 --rounds 2 --delay 5 ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fullstack import Backend, backend, emails_check, pipeline_expected, serving, stored
from bench.harness import (
    ACCEPTED_BODY,
    PacedResult,
    latency_summary,
    load,
    pace,
    paid_batch,
    percentile,
)
from bench.report import Goal
from bench.run import (
    NO_LIMITS,
    FullStackOptions,
    cpu_per_item,
    cpu_snapshot,
    cpu_spent,
    owned_measure,
    run_config,
    stack_arguments,
    stack_fields,
    verdict,
)
from stack.process import Process

GOAL = 1.2  # p99 with the slow SMTP server / p99 with the instant one
ARMS = ("instant", "slow")


@dataclass(frozen=True, kw_only=True)
class Options(FullStackOptions):
    rate: float
    duration: float
    rounds: int
    senders: int
    delay: float
    drain_timeout: float


@dataclass(frozen=True)
class ArmRun:
    arm: str
    round: int
    result: PacedResult
    emails_during: int  # emails the sink received while the arm ran
    drain_seconds: float  # after the arm, until every email so far had arrived
    cpu: dict[str, float]


def accepted(result: PacedResult) -> tuple[list[float], dict[str, int]]:
    """Latencies of the requests acknowledged as new events, and the others by kind."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    for outcome in result.outcomes:
        if outcome is None:
            kind = "not sent"
        elif outcome.status == 200 and ACCEPTED_BODY in outcome.body:
            latencies.append(outcome.latency)
            continue
        else:
            kind = outcome.error or f"HTTP {outcome.status}"
        errors[kind] = errors.get(kind, 0) + 1
    return latencies, errors


class AckLatency:
    def __init__(self, *, backend: Backend, server: Process, options: Options) -> None:
        self.backend = backend
        self.server = server
        self.options = options
        self.invoices: list[str] = []

    def warm_up(self, count: int = 50) -> None:
        batch = paid_batch(count, port=self.server.port, secret=self.backend.run.secret)
        result = load(
            port=self.server.port,
            requests=batch.requests,
            duration=60,
            concurrency=4,
            expect=ACCEPTED_BODY,
            cycle=False,
        )
        self.invoices += batch.invoice_ids
        if result.successes != count:
            raise RuntimeError(f"warm-up: {dict(result.errors)}")
        self.drain()

    def drain(self) -> float:
        """Make the sink instant and wait for every email posted so far; seconds waited."""
        self.backend.sink.handler.faults.delay = 0.0
        started = time.perf_counter()
        self.backend.wait_emails(len(self.invoices), self.options.drain_timeout)
        return time.perf_counter() - started

    def run(self, arm: str, round_: int) -> ArmRun:
        options = self.options
        count = max(1, round(options.rate * options.duration))
        batch = paid_batch(count, port=self.server.port, secret=self.backend.run.secret)
        groups = self.backend.cpu_groups(self.server)
        self.backend.sink.handler.faults.delay = options.delay if arm == "slow" else 0.0
        emails_before = self.backend.emails
        before = cpu_snapshot(groups)
        result = pace(
            port=self.server.port,
            requests=batch.requests,
            rate=options.rate,
            senders=options.senders,
        )
        cpu = cpu_spent(before, cpu_snapshot(groups))
        emails_during = self.backend.emails - emails_before
        self.invoices += batch.invoice_ids
        return ArmRun(
            arm=arm,
            round=round_,
            result=result,
            emails_during=emails_during,
            drain_seconds=self.drain(),
            cpu=cpu,
        )


def summarize(runs: Sequence[ArmRun]) -> dict[str, Any]:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    lags: list[float] = []
    for run in runs:
        ok, failed = accepted(run.result)
        latencies += ok
        lags += [outcome.lag for outcome in run.result.sent()]
        for kind, n in failed.items():
            errors[kind] = errors.get(kind, 0) + n
    requests = sum(len(run.result.outcomes) for run in runs)
    cpu = {group: sum(run.cpu[group] for run in runs) for group in runs[0].cpu}
    return {
        "requests": requests,
        "accepted": len(latencies),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "offered_rate": runs[0].result.rate,
        **latency_summary(latencies),
        "round_p99_ms": [
            round(percentile(sorted(accepted(run.result)[0]), 99) * 1000, 1) for run in runs
        ],
        "max_lag_ms": max(lags, default=math.nan) * 1000,
        "emails_during": sum(run.emails_during for run in runs),
        "drain_seconds": [round(run.drain_seconds, 1) for run in runs],
        "cpu_ms_per_request": cpu_per_item(cpu, requests),
    }


def goals(arms: dict[str, dict[str, Any]]) -> list[Goal]:
    slow, instant = arms["slow"], arms["instant"]
    return [
        Goal(
            source="ack_latency",
            metric="webhook p99 ack, 5 s SMTP ÷ instant SMTP",
            value=f"{slow['p99_ms']:.1f} / {instant['p99_ms']:.1f} ms",
            measured=slow["p99_ms"] / instant["p99_ms"],
            op="<=",
            limit=GOAL,
        )
    ]


def checks(bench: AckLatency, options: Options) -> dict[str, Any]:
    time.sleep(2.0)  # room for a duplicate email, were there one
    found = stored(options.database_url)
    expected = pipeline_expected(len(bench.invoices))
    emails = emails_check(bench.backend.sink, bench.invoices)
    return {
        "expected": expected,
        "found": found,
        "sink": emails,
        "ok": found == expected and emails["ok"],
    }


def measure(options: Options, prefix: str) -> dict[str, Any]:
    run = run_config("ack_latency", prefix, options)
    runs: list[ArmRun] = []
    with backend(run, settings=NO_LIMITS) as stack, serving(stack) as server:
        bench = AckLatency(backend=stack, server=server, options=options)
        bench.warm_up()
        print(
            f"warmed up; {options.rounds} round(s) x {options.duration:g} s per arm "
            f"at {options.rate:g} events/s",
            flush=True,
        )
        for round_ in range(options.rounds):
            order = ARMS if round_ % 2 == 0 else ARMS[::-1]
            for arm in order:
                result = bench.run(arm, round_)
                runs.append(result)
                ok, errors = accepted(result.result)
                latency = latency_summary(ok)
                print(
                    f"  round {round_ + 1} {arm:<8} {len(ok)} acknowledged, errors {errors or 0}, "
                    f"p50 {latency['p50_ms']:.1f} ms, p99 {latency['p99_ms']:.1f} ms; "
                    f"{result.emails_during} emails meanwhile, drained in "
                    f"{result.drain_seconds:.1f} s",
                    flush=True,
                )
        state = checks(bench, options)
    arms = {arm: summarize([r for r in runs if r.arm == arm]) for arm in ARMS}
    return {
        "arms": arms,
        "summary": [goal.as_dict() for goal in goals(arms)],
        "checks": state,
        "incidents": stack.incidents,
    }


def report(options: Options, results: dict[str, Any]) -> str:
    arms = results["arms"]
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.workers.describe()}; open loop at "
        f"{options.rate:g}/s from up to {options.senders} senders; {options.rounds} round(s) x "
        f"{options.duration:g} s per arm; slow SMTP: {options.delay:g} s per message",
        "",
        f"{'arm':<8} {'requests':>8} {'ok':>6} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'p99.9':>7} {'max ms':>7} {'lag ms':>7} {'emails':>6}  per-round p99",
    ]
    for arm, s in arms.items():
        lines.append(
            f"{arm:<8} {s['requests']:>8} {s['accepted']:>6} {s['errors']:>6} "
            f"{s['p50_ms']:>7.1f} {s['p99_ms']:>7.1f} {s['p99_9_ms']:>7.1f} {s['max_ms']:>7.1f} "
            f"{s['max_lag_ms']:>7.1f} {s['emails_during']:>6}  "
            + " ".join(f"{p:.1f}" for p in s["round_p99_ms"])
        )
    groups = list(arms["instant"]["cpu_ms_per_request"])
    lines += ["", "CPU ms per request " + " ".join(f"{g:>9}" for g in groups)]
    for arm, s in arms.items():
        cpu = s["cpu_ms_per_request"]
        lines.append(f"  {arm:<16} " + " ".join(f"{cpu[g]:>9.2f}" for g in groups))
    lines.append("")
    lines += [Goal.from_dict(goal).line() for goal in results["summary"]]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ack_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=25, help="events posted per second")
    parser.add_argument("--duration", type=float, default=20, help="seconds per arm")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two arms")
    parser.add_argument("--senders", type=int, default=16, help="sender threads (open loop)")
    parser.add_argument("--delay", type=float, default=5.0, help="slow SMTP: seconds per DATA")
    parser.add_argument("--drain-timeout", type=float, default=300)
    stack_arguments(parser, name="ack_latency")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.rounds < 1:
        parser.error("--rate, --duration and --rounds must be positive")
    return Options(
        rate=args.rate,
        duration=args.duration,
        rounds=args.rounds,
        senders=args.senders,
        delay=args.delay,
        drain_timeout=args.drain_timeout,
        **stack_fields(args),
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="ack_latency",
        config={
            "workers": options.workers.describe(),
            "rate": options.rate,
            "duration_s": options.duration,
            "rounds": options.rounds,
            "senders": options.senders,
            "slow_smtp_delay_s": options.delay,
            "server_settings": NO_LIMITS,
        },
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results))
    failed = sum(arm["errors"] for arm in results["arms"].values())
    return verdict(
        options,
        results["checks"],
        failures=f"{failed} request(s) not acknowledged" if failed else "",
    )


if __name__ == "__main__":
    sys.exit(main())
