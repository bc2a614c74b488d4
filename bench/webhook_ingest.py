"""Webhook ingest under concurrency, against gunicorn: what the webhook's own work costs.

Deliveries per second and p50/p99 acknowledgement latency of ``POST /webhooks/stripe/`` for
five arms in one run, so their ratios are the webhook's cost on whatever machine runs it; four
served by one gunicorn, through the same middleware:

* ``noop``: the baseline, a Django view that reads the body and answers (``bench.urls``);
* ``unique``: a new ``invoice.paid`` event per delivery: the whole view, then event, invoice and
  outbox row in one transaction, and the Celery publish on commit;
* ``tutorial``: the same new events posted to the tutorial's webhook (``bench/tutorial.py``: the
  view a Django team writes from the tutorials: stripe-python's ``construct_event``,
  ``get_or_create`` of the event, ``update_or_create`` of the invoice, ``delay_on_commit``);
* ``duplicate``: 100% redeliveries of stored events (a provider's retry storm);

and ``floor``: the same new events posted to the floor receiver (``bench/floor_receiver.py``:
a bare WSGI callable that verifies, parses, commits event, invoice and outbox row in one
statement and publishes), served by a second gunicorn of the same configuration.

Requests are real Stripe deliveries, signed before timing; arms interleave over rounds, each
after a warm-up. Goals: ingest at least the tutorial's rate, the median of the rounds' rates
(the guarantees at no cost); duplicates no slower than unique events. The ratios to the floor
receiver's rate and to the no-op's are reported, not goals. A missed goal prints MISS and exits
0; a failed request or a wrong stored state (one event and invoice per acknowledged new event,
one published outbox row for the application's and the floor's, one message in Redis for each)
exits 1. No Celery worker runs: published messages wait in Redis, under the run's own prefix,
deleted at the end.

    .venv/bin/python -m bench.webhook_ingest [--rounds 4 --duration 10 --workers 3 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.fullstack import stored
from bench.harness import WEBHOOK_PATH, LoadResult, load, paid_event, percentile, signed_requests
from bench.report import Goal
from bench.run import (
    DATABASE_URL,
    NO_LIMITS,
    NOOP_PATH,
    REDIS_URL,
    RESULTS,
    TUTORIAL_PATH,
    RunConfig,
    StackOptions,
    cpu_metered,
    floor_web,
    owned_measure,
    redis_queued,
    stack_env,
    stack_pids,
    verdict,
    web,
)
from stack.launch import GunicornConfig
from stack.process import Process

ARMS = ("noop", "unique", "tutorial", "floor", "duplicate")
NEW_EVENTS = ("unique", "tutorial", "floor")  # the arms whose every delivery is a new event
# A success is a 200 whose body says what the arm should have done.
EXPECTED_BODY = {
    "noop": b'"received": true',
    "unique": b'"duplicate": false',
    "tutorial": b'"duplicate": false',
    "floor": b'"duplicate": false',
    "duplicate": b'"duplicate": true',
}
PATHS = {"noop": NOOP_PATH, "tutorial": TUTORIAL_PATH}  # the others post to the webhook
# An arm's first batch of new events, before its own rate is known: sized for this many times
# the unique rate.
FIRST_GUESS = {"unique": 1.0, "tutorial": 1.0, "floor": 3.0}
# The guarantees at no cost: ingest at least the tutorial's rate, as the median of the rounds'
# rates (the arms interleaved). The floor's ratio is reported, not a goal.
TUTORIAL_GOAL = 1.0


@dataclass(frozen=True, kw_only=True)
class Options(StackOptions):
    rounds: int
    duration: float
    warmup: float
    concurrency: int
    duplicates: int


@dataclass(frozen=True)
class ArmRun:
    """One measured run of one arm, and the CPU seconds each part of the stack spent on it."""

    arm: str
    round: int
    result: LoadResult
    cpu: dict[str, float]


class IngestBenchmark:
    """The arms against their running servers; tracks what each should have stored."""

    def __init__(self, *, server: Process, floor: Process, options: Options, secret: str) -> None:
        self.server = server
        self.floor = floor
        self.options = options
        self.secret = secret
        self.duplicate_bodies = [paid_event() for _ in range(options.duplicates)]
        self.noop_bodies = [paid_event() for _ in range(options.duplicates)]
        # New events acknowledged by each arm that takes them, warm-ups included.
        self.stored: Counter[str] = Counter()
        # The best rate seen of each such arm, to size its next batch of events.
        self.rates: dict[str, float] = {}

    def _requests(self, bodies: Sequence[bytes], path: str) -> list[bytes]:
        return signed_requests(bodies, path=path, port=self.server.port, secret=self.secret)

    def _server(self, arm: str) -> Process:
        return self.floor if arm == "floor" else self.server

    def _pids(self, arm: str) -> dict[str, list[int]]:
        return stack_pids(
            gunicorn=self._server(arm).pids(),
            database=urlsplit(self.options.database_url).path.lstrip("/"),
        )

    def _load(self, arm: str, requests: Sequence[bytes], duration: float) -> LoadResult:
        result = load(
            port=self._server(arm).port,
            requests=requests,
            duration=duration,
            concurrency=self.options.concurrency,
            expect=EXPECTED_BODY[arm],
            cycle=arm not in NEW_EVENTS,
        )
        if arm in NEW_EVENTS:
            self.stored[arm] += result.successes
        return result

    def store_duplicates(self) -> LoadResult:
        """Deliver the events the ``duplicate`` arm will redeliver, once each."""
        requests = self._requests(self.duplicate_bodies, WEBHOOK_PATH)
        result = self._load("unique", requests, duration=math.inf)
        if result.errors or result.successes != len(requests):
            raise RuntimeError(f"storing the events to duplicate failed: {dict(result.errors)}")
        self.rates["unique"] = result.rate
        return result

    def _arm_requests(self, arm: str, duration: float) -> list[bytes]:
        path = PATHS.get(arm, WEBHOOK_PATH)
        if arm == "noop":
            return self._requests(self.noop_bodies, path)
        if arm == "duplicate":
            return self._requests(self.duplicate_bodies, path)
        # Twice the arm's best rate so far: the run should end by its clock, not by running out.
        rate = self.rates.get(arm) or FIRST_GUESS[arm] * self.rates["unique"]
        count = math.ceil(2 * rate * duration) + 10 * self.options.concurrency
        return self._requests([paid_event() for _ in range(count)], path)

    def run(self, arm: str, round_: int) -> ArmRun:
        self._load(arm, self._arm_requests(arm, self.options.warmup), self.options.warmup)
        requests = self._arm_requests(arm, self.options.duration)
        with cpu_metered(lambda: self._pids(arm)) as cpu:
            result = self._load(arm, requests, self.options.duration)
        if arm in NEW_EVENTS:
            self.rates[arm] = max(self.rates.get(arm, 0.0), result.rate)
        return ArmRun(arm=arm, round=round_, result=result, cpu=cpu)


def summarize(runs: Sequence[ArmRun]) -> dict[str, Any]:
    """Pool the rounds of one arm: totals, the rate over all measured time, pooled latencies."""
    elapsed = sum(run.result.elapsed for run in runs)
    latencies = sorted(latency for run in runs for latency in run.result.latencies)
    successes = len(latencies)
    errors: Counter[str] = sum((run.result.errors for run in runs), Counter())
    cpu_groups = runs[0].cpu.keys()
    cpu = {group: sum(run.cpu[group] for run in runs) for group in cpu_groups}
    return {
        "requests": sum(run.result.requests for run in runs),
        "successes": successes,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "seconds": round(elapsed, 3),
        "rate": successes / elapsed,
        "round_rates": [round(run.result.rate, 1) for run in runs],
        "exhausted_rounds": sum(run.result.exhausted for run in runs),
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "max_ms": latencies[-1] * 1000 if latencies else math.nan,
        "cpu_ms_per_delivery": {
            group: seconds * 1000 / successes if successes else math.nan
            for group, seconds in cpu.items()
        },
        "machine_busy": cpu["all"] / (elapsed * (os.cpu_count() or 1)),
    }


def goals(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    noop, unique, duplicate = arms["noop"], arms["unique"], arms["duplicate"]
    tutorial, floor = arms["tutorial"], arms["floor"]
    ratios = {
        "unique_over_tutorial_rate": unique["rate"] / tutorial["rate"],
        "unique_over_tutorial_median_rate": (
            statistics.median(unique["round_rates"]) / statistics.median(tutorial["round_rates"])
        ),
        "unique_over_floor_rate": unique["rate"] / floor["rate"],
        "unique_over_noop_rate": unique["rate"] / noop["rate"],
        "duplicate_over_noop_rate": duplicate["rate"] / noop["rate"],
        "duplicate_over_unique_rate": duplicate["rate"] / unique["rate"],
        "duplicate_over_unique_p50": duplicate["p50_ms"] / unique["p50_ms"],
        "duplicate_over_unique_p99": duplicate["p99_ms"] / unique["p99_ms"],
    }
    return {
        "ratios": ratios,
        "goals": {
            f"median ingest rate >= {TUTORIAL_GOAL} x the tutorial's (unique events)": (
                ratios["unique_over_tutorial_median_rate"] >= TUTORIAL_GOAL
            ),
            "duplicates no slower than unique (rate >=, p50 and p99 <=)": (
                ratios["duplicate_over_unique_rate"] >= 1
                and ratios["duplicate_over_unique_p50"] <= 1
                and ratios["duplicate_over_unique_p99"] <= 1
            ),
        },
    }


def summary_goals(arms: dict[str, dict[str, Any]], ratios: dict[str, float]) -> list[Goal]:
    """The goal rows of ``python -m bench``'s table and of the docs: ingest against the
    tutorial's webhook, the median of the rounds' rates (with gunicorn's CPU per delivery of
    each), and duplicates against unique events."""
    unique, tutorial, duplicate = arms["unique"], arms["tutorial"], arms["duplicate"]
    cpu = (arms[a]["cpu_ms_per_delivery"]["gunicorn"] for a in ("unique", "tutorial"))
    rounds = len(unique["round_rates"])
    return [
        Goal(
            source="webhook_ingest",
            metric="webhook ingest/s ÷ tutorial webhook/s, median of the rounds "
            "(gunicorn CPU ms per webhook)",
            value=f"{statistics.median(unique['round_rates']):.0f} / "
            f"{statistics.median(tutorial['round_rates']):.0f} per s, {rounds} rounds "
            f"({' / '.join(f'{ms:.2f}' for ms in cpu)} ms)",
            measured=ratios["unique_over_tutorial_median_rate"],
            op=">=",
            limit=TUTORIAL_GOAL,
        ),
        Goal(
            source="webhook_ingest",
            metric="ingest of 100% duplicates ÷ unique",
            value=f"{duplicate['rate']:.0f} / {unique['rate']:.0f} per s",
            measured=ratios["duplicate_over_unique_rate"],
            op=">=",
            limit=1.0,
        ),
    ]


def report(options: Options, arms: dict[str, dict[str, Any]], verdict: dict[str, Any]) -> str:
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.concurrency} concurrent senders; "
        f"{options.rounds} round(s) x {options.duration:g} s per arm after "
        f"{options.warmup:g} s warm-up; {os.cpu_count()} CPUs",
        "",
        f"{'arm':<10} {'requests':>9} {'ok':>9} {'errors':>6} {'deliv/s':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'max ms':>7}  per-round deliv/s",
    ]
    for arm, s in arms.items():
        rounds = " ".join(f"{rate:.0f}" for rate in s["round_rates"])
        lines.append(
            f"{arm:<10} {s['requests']:>9} {s['successes']:>9} {s['errors']:>6} "
            f"{s['rate']:>8.0f} {s['p50_ms']:>7.2f} {s['p99_ms']:>7.2f} {s['max_ms']:>7.1f}  "
            f"{rounds}"
        )
    groups = list(next(iter(arms.values()))["cpu_ms_per_delivery"])
    lines += [
        "",
        "CPU ms per delivery  " + " ".join(f"{g:>8}" for g in groups) + "  busy",
    ]
    for arm, s in arms.items():
        cpu = s["cpu_ms_per_delivery"]
        figures = " ".join(f"{cpu[g]:>8.3f}" for g in groups)
        lines.append(f"  {arm:<18} {figures}  {s['machine_busy']:>4.0%}")
    r = verdict["ratios"]
    lines += [
        "",
        f"unique/tutorial rate {r['unique_over_tutorial_rate']:.2f}   "
        f"unique/floor rate {r['unique_over_floor_rate']:.2f}   "
        f"unique/noop rate {r['unique_over_noop_rate']:.2f}   "
        f"duplicate/noop rate {r['duplicate_over_noop_rate']:.2f}   "
        f"duplicate/unique rate {r['duplicate_over_unique_rate']:.2f}, "
        f"p50 {r['duplicate_over_unique_p50']:.2f}, p99 {r['duplicate_over_unique_p99']:.2f}",
    ]
    lines += [f"{'PASS' if ok else 'MISS'}  {goal}" for goal, ok in verdict["goals"].items()]
    return "\n".join(lines)


def checks(options: Options, prefix: str, acknowledged: Mapping[str, int]) -> dict[str, Any]:
    """What the run left behind must match what it was told (``acknowledged``: new events, by
    arm): every new event stored once with its invoice, and published to Redis; an outbox row,
    published, for each of the application's and the floor receiver's (which writes its rows
    published); none for the tutorial's, which has no outbox."""
    counts = stored(options.database_url)
    found = {
        **{name: counts[name] for name in ("events", "invoices", "outbox", "outbox_unpublished")},
        "broker_messages": redis_queued(url=options.redis_url, prefix=prefix),
    }
    total = sum(acknowledged.values())
    expected = {"events": total, "invoices": total}
    expected |= {"outbox": acknowledged["unique"] + acknowledged["floor"]}
    expected |= {"outbox_unpublished": 0, "broker_messages": total}
    return {"expected": expected, "found": found, "ok": found == expected}


def measure(options: Options, prefix: str) -> dict[str, Any]:
    """Serve (no Celery worker: published messages wait in Redis), store the events to
    redeliver, run the rounds, and check what was stored."""
    run = RunConfig(
        name="webhook_ingest",
        prefix=prefix,
        database_url=options.database_url,
        redis_url=options.redis_url,
        gunicorn=options.gunicorn,
    )
    runs: list[ArmRun] = []
    env = stack_env(run, settings=NO_LIMITS)
    with (
        web(env, run.gunicorn, log=run.name) as server,
        floor_web(env, run.gunicorn, log=run.name) as floor,
    ):
        bench = IngestBenchmark(server=server, floor=floor, options=options, secret=run.secret)
        stored_first = bench.store_duplicates()
        print(
            f"stored {stored_first.successes} events to redeliver ({stored_first.rate:.0f}/s); "
            f"running {options.rounds} round(s)",
            flush=True,
        )
        for round_ in range(options.rounds):
            order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
            for arm in order:
                result = bench.run(arm, round_)
                runs.append(result)
                print(
                    f"  round {round_ + 1} {arm:<9} {result.result.rate:7.0f}/s "
                    f"p50 {percentile(sorted(result.result.latencies), 50) * 1000:6.2f} ms "
                    f"errors {sum(result.result.errors.values())}",
                    flush=True,
                )
    stored_checks = checks(options, prefix, bench.stored)
    arms = {arm: summarize([run for run in runs if run.arm == arm]) for arm in ARMS}
    verdicts = goals(arms)
    summary = [goal.as_dict() for goal in summary_goals(arms, verdicts["ratios"])]
    return {"arms": arms, **verdicts, "summary": summary, "checks": stored_checks}


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.webhook_ingest", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the five arms")
    parser.add_argument("--duration", type=float, default=10, help="measured seconds per arm")
    parser.add_argument("--warmup", type=float, default=2, help="unmeasured seconds before each")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent senders")
    parser.add_argument(
        "--duplicates", type=int, default=2000, help="events stored once, then redelivered"
    )
    parser.add_argument("--worker-class", default="sync", choices=["sync", "gthread"])
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers (processes)")
    parser.add_argument("--threads", type=int, default=1, help="threads per gthread worker")
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--output", type=Path, default=RESULTS / "webhook_ingest.json")
    args = parser.parse_args(argv)
    return Options(
        rounds=args.rounds,
        duration=args.duration,
        warmup=args.warmup,
        concurrency=args.concurrency,
        duplicates=args.duplicates,
        gunicorn=GunicornConfig(
            worker_class=args.worker_class, workers=args.workers, threads=args.threads
        ),
        database_url=args.database_url,
        redis_url=args.redis_url,
        output=args.output,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="webhook_ingest",
        config={
            "concurrency": options.concurrency,
            "rounds": options.rounds,
            "duration_s": options.duration,
            "warmup_s": options.warmup,
            "duplicates": options.duplicates,
            "server_settings": NO_LIMITS,
        },
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results["arms"], results))
    failed = sum(arm["errors"] for arm in results["arms"].values())
    return verdict(
        options,
        results["checks"],
        failures=f"{failed} request(s) did not succeed" if failed else "",
    )


if __name__ == "__main__":
    sys.exit(main())
