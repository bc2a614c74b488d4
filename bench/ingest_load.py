"""Webhook ingest against its own maximum: acknowledgement latency at 70% of it, and overload at
twice it, with the whole stack running (gunicorn, Celery workers, an SMTP sink).

A provider's traffic comes in bursts; what matters is that the acknowledgement stays fast below
capacity and that, above it, the excess is refused fast (the provider retries it) while what is
admitted still flows and nothing acknowledged is lost. Phases, in one run:

1. ``max``: the maximum ingest rate, closed-loop, edge limit and backpressure out of the way.
2. ``70%``: open-loop at 0.7 x max; latency from when each request was due. Goal: p99.9
   <= 500 ms.
3. ``overload``: open-loop at 2 x max through the edge (nginx from ``deploy/nginx``, as
   compose.yaml runs it), its limit configured for the capacity just measured: max is measured
   again through an nginx without limits (the path the admitted events take), and the edge,
   the overload and the goodput are set from that. Goals: goodput at least 0.9
   of max; refusals (429, 503) with p99 <= 20 ms; nothing acknowledged lost.

At the end the invoices stored are exactly the events acknowledged, each with one email and no
dead letter. The method in full: ``bench/README.md``.

    .venv/bin/python -m bench.ingest_load [--max-duration 10 --duration 20 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fullstack import (
    Backend,
    backend,
    emails_check,
    pipeline_expected,
    serving,
    stored,
    stored_invoice_ids,
)
from bench.harness import ACCEPTED_BODY, PacedResult, latency_summary, load, pace, paid_batch
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
from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST
from stack.process import Process

P999_GOAL_MS = 500.0
GOODPUT_GOAL = 0.9
SHED_P99_GOAL_MS = 20.0
# Where the overload through the edge comes from: a provider's addresses (Stripe's list has a
# dozen), each of which the edge limits to a quarter of the capacity.
EDGE_SOURCES = tuple(f"127.0.0.{n}" for n in range(1, 9))
# The application's defaults (core/settings.py), restored for the overload phase.
DEFAULT_MARKS = {"BACKPRESSURE_SOFT_MARK": "5000", "BACKPRESSURE_HARD_MARK": "50000"}


@dataclass(frozen=True, kw_only=True)
class Options(FullStackOptions):
    max_duration: float
    duration: float
    fraction: float
    overload: float
    throttle: list[float]
    senders: int
    pace_senders: int
    overload_senders: int
    drain_timeout: float


def classify(result: PacedResult, invoice_ids: Sequence[str]) -> dict[str, Any]:
    """Each request by answer: acknowledged as new, refused (429, 503), or anything else."""
    accepted_ids: list[str] = []
    accepted: list[float] = []
    refused: list[float] = []
    by_status: dict[str, int] = {}
    other: dict[str, int] = {}
    for outcome, invoice in zip(result.outcomes, invoice_ids, strict=True):
        if outcome is None:
            other["not sent"] = other.get("not sent", 0) + 1
            continue
        key = outcome.error or str(outcome.status)
        by_status[key] = by_status.get(key, 0) + 1
        if outcome.status == 200 and ACCEPTED_BODY in outcome.body:
            accepted.append(outcome.latency)
            accepted_ids.append(invoice)
        elif outcome.status in (429, 503):
            refused.append(outcome.latency)
        else:
            other[key] = other.get(key, 0) + 1
    lags = [outcome.lag for outcome in result.sent()]
    return {
        "offered": len(result.outcomes),
        "offered_rate": result.rate,
        "elapsed": result.elapsed,
        "accepted": len(accepted),
        "refused": len(refused),
        "other": sum(other.values()),
        "other_kinds": other,
        "by_status": by_status,
        "accepted_latency": latency_summary(accepted),
        "refused_latency": latency_summary(refused),
        "max_lag_ms": max(lags, default=math.nan) * 1000,
        "late_10ms": sum(1 for lag in lags if lag > 0.010),
        "accepted_ids": accepted_ids,
    }


class IngestLoad:
    def __init__(self, *, backend: Backend, options: Options) -> None:
        self.backend = backend
        self.options = options
        self.accepted: list[str] = []  # invoices acknowledged as new, every phase

    def drain(self) -> float:
        started = time.perf_counter()
        self.backend.wait_emails(len(self.accepted), self.options.drain_timeout)
        return time.perf_counter() - started

    def closed(
        self,
        server: Process,
        *,
        count: int,
        duration: float,
        warmup: bool = False,
        port: int = 0,
    ) -> dict[str, Any]:
        """Post up to ``count`` new events back to back for ``duration`` seconds (a warm-up
        posts all ``count``; a measurement must still have events left at the end), to
        ``port`` if given (the edge), else to gunicorn."""
        port = port or server.port
        batch = paid_batch(count, port=port, secret=self.backend.run.secret)
        groups = self.backend.cpu_groups(server)
        before = cpu_snapshot(groups)
        result = load(
            port=port,
            requests=batch.requests,
            duration=duration,
            concurrency=self.options.senders,
            expect=ACCEPTED_BODY,
            cycle=False,
        )
        cpu = cpu_spent(before, cpu_snapshot(groups))
        # The senders take requests in order: the first ``requests`` were sent, and every one
        # of them must have been acknowledged.
        self.accepted += batch.invoice_ids[: result.requests]
        if result.errors:
            raise RuntimeError(f"posting at the maximum rate failed: {dict(result.errors)}")
        if result.exhausted and not warmup:
            raise RuntimeError("ran out of events before the time was up: raise the estimate")
        return {
            "rate": result.rate,
            "requests": result.requests,
            "seconds": result.elapsed,
            "cpu_ms_per_request": cpu_per_item(cpu, result.requests),
        }

    def maximum(self, server: Process, *, port: int = 0, path: str = "") -> dict[str, Any]:
        """The closed-loop maximum (through ``port``, if given: the edge), then the backlog
        drained."""
        duration = self.options.max_duration
        top = self.closed(server, count=round(600 * duration), duration=duration, port=port)
        print(f"  maximum{path}: {top['rate']:.1f} events/s closed-loop", flush=True)
        top["drain_s"] = self.drain()
        return top

    def edge_maximum(self, server: Process) -> dict[str, Any]:
        """The closed-loop maximum through the edge with its limits out of the way: the
        capacity of the path the overload's admitted events take (nginx's proxying runs on the
        same cores as the application), which the overload's edge is set from and its goodput
        is measured against."""
        with edge_unlimited(server.port, senders=self.options.senders) as front:
            return self.maximum(server, port=front.port, path=" through the edge")

    def paced(
        self,
        server: Process,
        *,
        rate: float,
        senders: int,
        port: int = 0,
        sources: Sequence[str] = ("127.0.0.1",),
    ) -> dict[str, Any]:
        """Post new events open-loop at ``rate`` from the addresses in ``sources``, to ``port``
        if given (the edge), else to gunicorn."""
        port = port or server.port
        count = max(1, round(rate * self.options.duration))
        batch = paid_batch(count, port=port, secret=self.backend.run.secret)
        groups = self.backend.cpu_groups(server)
        before = cpu_snapshot(groups)
        result = pace(
            port=port, requests=batch.requests, rate=rate, senders=senders, sources=sources
        )
        cpu = cpu_spent(before, cpu_snapshot(groups))
        summary = classify(result, batch.invoice_ids)
        self.accepted += summary.pop("accepted_ids")
        summary["goodput"] = summary["accepted"] / result.elapsed if result.elapsed else 0.0
        summary["cpu_ms_per_request"] = cpu_per_item(cpu, count)
        return summary


def edge_unlimited(upstream_port: int, *, senders: int) -> Process:
    """nginx of the edge's template in front of ``upstream_port`` with its limits out of the
    way for ``senders`` closed-loop senders from one address, which may use each webhook limit
    whole (``stack.nginx``): the path of the edge without its admission."""
    unlimited, in_flight = 1_000_000, 4 * senders
    whole = {
        "WEBHOOK_EDGE_ADDRESS_RATE": unlimited,
        "WEBHOOK_EDGE_ADDRESS_BURST": unlimited,
        "WEBHOOK_EDGE_ADDRESS_CONNECTIONS": in_flight,
    }
    return launch.edge(
        upstream_port, rate=unlimited, burst=unlimited, in_flight=in_flight, settings=whole
    )


def checks(bench: IngestLoad, options: Options) -> dict[str, Any]:
    """Stored invoices are exactly the acknowledged events; one email each; no dead letter."""
    time.sleep(2.0)
    found = stored(options.database_url)
    ids = stored_invoice_ids(options.database_url)
    wanted = set(bench.accepted)
    emails = emails_check(bench.backend.sink, bench.accepted)
    expected = pipeline_expected(len(bench.accepted))
    return {
        "expected": expected,
        "found": found,
        "acknowledged_not_stored": len(wanted - ids),
        "stored_not_acknowledged": len(ids - wanted),
        "sink": emails,
        "ok": found == expected and ids == wanted and emails["ok"],
    }


def measure(options: Options, prefix: str) -> dict[str, Any]:
    run = run_config("ingest_load", prefix, options)
    phases: dict[str, Any] = {}
    with backend(run, settings=NO_LIMITS) as stack:
        bench = IngestLoad(backend=stack, options=options)
        with serving(stack) as server:
            bench.closed(server, count=50, duration=60, warmup=True)
            bench.drain()
            phases["max"] = top = bench.maximum(server)
            rate = options.fraction * top["rate"]
            phases["fraction"] = steady = bench.paced(
                server, rate=rate, senders=options.pace_senders
            )
            latency = steady["accepted_latency"]
            print(
                f"  {options.fraction:.0%} ({rate:.1f}/s): p50 {latency['p50_ms']:.1f} ms, "
                f"p99 {latency['p99_ms']:.1f} ms, p99.9 {latency['p99_9_ms']:.1f} ms; "
                f"not acknowledged {steady['refused'] + steady['other']}",
                flush=True,
            )
            steady["drain_s"] = bench.drain()
            # Measured again just before the overload: the neighbours' load moves.
            phases["max_again"] = top = bench.maximum(server)
        phases["overload"] = []
        for fraction in options.throttle:
            # Behind nginx: the client address from the proxy.
            admission = {"TRUSTED_PROXIES": HOST, **DEFAULT_MARKS}
            log = f"ingest_load.overload-{fraction:g}"
            with contextlib.ExitStack() as running:
                server = running.enter_context(serving(stack, settings=admission, log=log))
                bench.closed(server, count=20, duration=60, warmup=True)
                bench.drain()
                # The capacity through the edge, then the edge set for it.
                reference = bench.edge_maximum(server)
                limit = limit_of(fraction, reference)
                label = f"nginx edge {limit}/s"
                front = running.enter_context(
                    launch.edge(
                        server.port,
                        rate=limit,
                        burst=max(1, limit // 5),
                        in_flight=2 * options.gunicorn.workers * options.gunicorn.threads,
                    )
                ).port
                rate = options.overload * reference["rate"]
                over = bench.paced(
                    server,
                    rate=rate,
                    senders=options.overload_senders,
                    port=front,
                    sources=EDGE_SOURCES,
                )
                over["admission"] = {**admission, "label": label}
                over["throttle_fraction"] = fraction
                over["reference"] = reference
                print(
                    f"  overload ({rate:.1f}/s, {label}): goodput "
                    f"{over['goodput']:.1f}/s, refused {over['refused']} (p99 "
                    f"{over['refused_latency']['p99_ms']:.1f} ms), "
                    f"other {over['other_kinds'] or 0}",
                    flush=True,
                )
                over["drain_s"] = bench.drain()
            phases["overload"].append(over)
        state = checks(bench, options)
    summary = [goal.as_dict() for goal in goals(phases, state)]
    return {
        "phases": phases,
        "summary": summary,
        "checks": state,
        "incidents": stack.incidents,
    }


def limit_of(fraction: float, reference: dict[str, Any]) -> int:
    """The admission limit, per second, at ``fraction`` of a measured maximum."""
    return max(1, math.floor(fraction * reference["rate"]))


def goals(phases: dict[str, Any], state: dict[str, Any]) -> list[Goal]:
    steady, over = phases["fraction"], phases["overload"][0]
    # The overload's own reference: the maximum through the path its admitted events take.
    top = over["reference"]
    latency = steady["accepted_latency"]
    refused = over["refused_latency"]
    admission = over["admission"]["label"]
    overload = (
        f"overload 2x max through the edge, {admission} ({over['throttle_fraction']:g} x max)"
    )
    # Acknowledged (any phase) but not stored, or stored but never emailed.
    lost = state["acknowledged_not_stored"] + state["sink"]["missing"]
    return [
        Goal(
            source="ingest_load",
            metric="webhook p99.9 ack at 70% of max ingest",
            value=f"{latency['p99_9_ms']:.1f} ms (p99 {latency['p99_ms']:.1f} ms) "
            f"at {steady['offered_rate']:.0f}/s",
            measured=latency["p99_9_ms"],
            op="<=",
            limit=P999_GOAL_MS,
            unit="ms",
        ),
        Goal(
            source="ingest_load",
            metric=f"{overload}: goodput ÷ max",
            value=f"{over['goodput']:.1f} / {top['rate']:.1f} per s",
            measured=over["goodput"] / top["rate"],
            op=">=",
            limit=GOODPUT_GOAL,
        ),
        Goal(
            source="ingest_load",
            metric=f"{overload}: p99 of 429/503",
            value=f"{refused['p99_ms']:.1f} ms ({over['refused']} refused)",
            measured=refused["p99_ms"] if over["refused"] else math.nan,
            op="<=",
            limit=SHED_P99_GOAL_MS,
            unit="ms",
        ),
        Goal(
            source="ingest_load",
            metric="acknowledged events lost (not stored or not emailed)",
            value=str(lost),
            measured=float(lost),
            op="<=",
            limit=0,
            unit="events",
        ),
    ]


def report(options: Options, results: dict[str, Any]) -> str:
    phases = results["phases"]
    first, again, steady = phases["max"], phases["max_again"], phases["fraction"]
    rows = [("70%", steady)] + [
        (f"2x, {over['throttle_fraction']:g}", over) for over in phases["overload"]
    ]
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.workers.describe()}",
        f"max: {first['rate']:.1f} events/s, then {again['rate']:.1f} just before the overload "
        f"({options.senders} closed-loop senders, {options.max_duration:g} s each)"
        + "".join(
            f"; {over['reference']['rate']:.1f} through the edge before overload "
            f"{over['throttle_fraction']:g}"
            for over in phases["overload"]
        ),
        "",
        f"{'phase':<10} {'offered/s':>9} {'sent':>6} {'ok':>6} {'429/503':>7} {'other':>5} "
        f"{'good/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'p99.9':>7} {'max ms':>7} {'lag ms':>7}",
    ]
    for name, phase in rows:
        latency = phase["accepted_latency"]
        lines.append(
            f"{name:<10} {phase['offered_rate']:>9.1f} {phase['offered']:>6} "
            f"{phase['accepted']:>6} {phase['refused']:>7} {phase['other']:>5} "
            f"{phase['goodput']:>7.1f} {latency['p50_ms']:>7.1f} {latency['p99_ms']:>7.1f} "
            f"{latency['p99_9_ms']:>7.1f} {latency['max_ms']:>7.1f} {phase['max_lag_ms']:>7.1f}"
        )
    lines.append("(latencies of the events acknowledged, from when each request was due)")
    for over in phases["overload"]:
        refused = over["refused_latency"]
        lines.append(
            f"overload, {over['admission']['label']}: answers "
            f"{over['by_status']}; refusals p50 {refused['p50_ms']:.1f} ms, p99 "
            f"{refused['p99_ms']:.1f} ms, max {refused['max_ms']:.1f} ms"
        )
    groups = list(first["cpu_ms_per_request"])
    lines += ["", "CPU ms per request " + " ".join(f"{g:>9}" for g in groups)]
    for name, phase in [("max", first), ("max again", again), *rows]:
        cpu = phase["cpu_ms_per_request"]
        lines.append(f"  {name:<16} " + " ".join(f"{cpu[g]:>9.2f}" for g in groups))
    lines.append("")
    lines += [Goal.from_dict(goal).line() for goal in results["summary"]]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ingest_load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--max-duration", type=float, default=10, help="seconds at maximum")
    parser.add_argument("--duration", type=float, default=20, help="seconds of each paced phase")
    parser.add_argument("--fraction", type=float, default=0.7, help="of max, for latency")
    parser.add_argument("--overload", type=float, default=2.0, help="x max, offered")
    parser.add_argument(
        "--throttle",
        default="1.0",
        help="the admission limit for the overload, as fractions of max: one overload run "
        "each, comma-separated; the goals use the first",
    )
    parser.add_argument("--senders", type=int, default=16, help="closed-loop senders for max")
    parser.add_argument("--pace-senders", type=int, default=64, help="threads at 70%%")
    parser.add_argument("--overload-senders", type=int, default=512, help="threads at 2x")
    parser.add_argument("--drain-timeout", type=float, default=300)
    stack_arguments(parser, name="ingest_load")
    parser.add_argument(
        "--gunicorn-threads", type=int, default=1, help="above 1: the gthread worker class"
    )
    args = parser.parse_args(argv)
    if min(args.max_duration, args.duration, args.fraction, args.overload) <= 0:
        parser.error("durations and rate factors must be positive")
    if min(args.gunicorn_workers, args.gunicorn_threads) < 1:
        parser.error("--gunicorn-workers and --gunicorn-threads must be at least 1")
    return Options(
        max_duration=args.max_duration,
        duration=args.duration,
        fraction=args.fraction,
        overload=args.overload,
        throttle=[float(f) for f in args.throttle.split(",") if f.strip()],
        senders=args.senders,
        pace_senders=args.pace_senders,
        overload_senders=args.overload_senders,
        drain_timeout=args.drain_timeout,
        **stack_fields(
            args,
            gunicorn=GunicornConfig(
                worker_class="gthread" if args.gunicorn_threads > 1 else "sync",
                workers=args.gunicorn_workers,
                threads=args.gunicorn_threads,
            ),
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="ingest_load",
        config={
            "workers": options.workers.describe(),
            "max_duration_s": options.max_duration,
            "duration_s": options.duration,
            "fraction": options.fraction,
            "overload": options.overload,
            "throttle_fractions": options.throttle,
            "senders": options.senders,
            "pace_senders": options.pace_senders,
            "overload_senders": options.overload_senders,
            "server_settings": NO_LIMITS,
        },
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results))
    steady = results["phases"]["fraction"]
    failed = steady["refused"] + steady["other"]
    return verdict(
        options,
        results["checks"],
        failures=f"{failed} request(s) at 70% not acknowledged" if failed else "",
    )


if __name__ == "__main__":
    sys.exit(main())
