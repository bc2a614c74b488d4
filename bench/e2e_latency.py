"""Webhook 200 -> SMTP 250: how long after its acknowledgement a paid invoice's email is taken
by the SMTP server, under paced load at a share of the maximum ingest rate (the goal: at 50%,
with an instant SMTP server, p50 at most 100 ms and p99 at most 1 s).

One run: the whole stack (gunicorn, the Celery workers, the kit's SMTP server, instant), the
closed-loop maximum ingest rate (``bench.ingest_load``'s), then new events posted open-loop at
``--fraction`` of it for ``--duration`` seconds; for each acknowledged event, the time from the
end of its 200 to the SMTP server's commit of its email (each Message-ID names its invoice).
Checks: every acknowledged event stored, emailed once, nothing dead-lettered.

    .venv/bin/python -m bench.e2e_latency [--fraction 0.5 --duration 20 --max-duration 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from bench import ingest_load
from bench.fullstack import backend, provider_invoice_id, serving
from bench.harness import latency_summary, pace, paid_batch
from bench.report import Goal
from bench.run import NO_LIMITS, owned_measure, run_config, verdict

P50_GOAL_MS = 100.0
P99_GOAL_MS = 1000.0
RATE: dict[str, float] = {}  # "fixed": --rate, a rate given instead of a share of the maximum


def measure(options: ingest_load.Options, prefix: str) -> dict[str, Any]:
    run = run_config("e2e_latency", prefix, options)
    with backend(run, settings=NO_LIMITS) as stack, serving(stack) as server:
        bench = ingest_load.IngestLoad(backend=stack, options=options)
        bench.closed(server, count=50, duration=60, warmup=True)
        bench.drain()
        top = bench.maximum(server)
        rate = RATE.get("fixed") or options.fraction * top["rate"]
        count = max(1, round(rate * options.duration))
        batch = paid_batch(count, port=server.port, secret=stack.run.secret)
        result = pace(
            port=server.port, requests=batch.requests, rate=rate, senders=options.pace_senders
        )
        summary = ingest_load.classify(result, batch.invoice_ids)
        accepted = summary.pop("accepted_ids")
        bench.accepted += accepted
        drain_s = bench.drain()
        emailed = {
            provider_invoice_id(received.message_id): received.at
            for received in stack.sink.handler.received()
        }
        wanted = set(accepted)
        acked = {
            invoice: result.started_at + outcome.done
            for outcome, invoice in zip(result.outcomes, batch.invoice_ids, strict=True)
            if outcome is not None and invoice in wanted
        }
        latencies = [max(0.0, emailed[invoice] - at) for invoice, at in acked.items()]
        stored_checks = ingest_load.checks(bench, options)
    e2e = latency_summary(latencies)
    print(
        f"  {options.fraction:.0%} of max ({rate:.1f}/s): 200 -> 250 p50 {e2e['p50_ms']:.1f} ms, "
        f"p99 {e2e['p99_ms']:.1f} ms over {len(latencies)} emails",
        flush=True,
    )
    where = f"{rate:.0f}/s" if RATE else f"{options.fraction:.0%} of max ingest"
    goals = [
        Goal(
            source="e2e_latency",
            metric=f"webhook 200 -> SMTP 250 p50 at {where}",
            value=f"{e2e['p50_ms']:.1f} ms at {rate:.0f}/s",
            measured=e2e["p50_ms"],
            op="<=",
            limit=P50_GOAL_MS,
            unit="ms",
        ),
        Goal(
            source="e2e_latency",
            metric=f"webhook 200 -> SMTP 250 p99 at {where}",
            value=f"{e2e['p99_ms']:.1f} ms at {rate:.0f}/s",
            measured=e2e["p99_ms"],
            op="<=",
            limit=P99_GOAL_MS,
            unit="ms",
        ),
    ]
    return {
        "maximum": top,
        "paced": summary,
        "rate": rate,
        "e2e_latency": e2e,
        "drain_s": drain_s,
        "summary": [goal.as_dict() for goal in goals],
        "checks": stored_checks,
        "incidents": stack.incidents,
    }


def parse(argv: Sequence[str] | None) -> ingest_load.Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.e2e_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--fraction", type=float, default=0.5, help="of max")
    parser.add_argument("--duration", type=float, default=20, help="seconds paced")
    parser.add_argument("--max-duration", type=float, default=10, help="seconds at maximum")
    parser.add_argument(
        "--rate",
        type=float,
        default=0,
        help="deliveries/s instead of --fraction x max, to compare runs at one rate",
    )
    parser.add_argument("--output", default="")
    args, rest = parser.parse_known_args(argv)
    if args.rate > 0:
        RATE["fixed"] = args.rate
    output = ["--output", args.output] if args.output else []
    options = ingest_load.parse(
        [
            *("--fraction", str(args.fraction), "--duration", str(args.duration)),
            *("--max-duration", str(args.max_duration), *output),
            *rest,
        ]
    )
    if not args.output:
        options = dataclasses.replace(options, output=options.output.with_name("e2e_latency.json"))
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="e2e_latency",
        config={
            "workers": options.workers.describe(),
            "fraction": options.fraction,
            "duration_s": options.duration,
            "max_duration_s": options.max_duration,
            "pace_senders": options.pace_senders,
            "server_settings": NO_LIMITS,
        },
    )
    if isinstance(results, int):
        return results
    for goal in results["summary"]:
        print(Goal.from_dict(goal).line())
    failed = results["paced"]["refused"] + results["paced"]["other"]
    return verdict(
        options,
        results["checks"],
        failures=f"{failed} paced request(s) not acknowledged" if failed else "",
    )


if __name__ == "__main__":
    sys.exit(main())
