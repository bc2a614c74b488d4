"""Celery worker memory under a long run of emails: peak RSS after 10k emails against after 1k
(goal: at most 1.1, so a leak shows before it takes a machine down).

The whole stack runs (gunicorn, Celery workers, an SMTP sink in this process) with the
application's worker settings (``CELERY_WORKER_MAX_TASKS_PER_CHILD`` 5000 and
``..._MAX_MEMORY_PER_CHILD`` 256 MB unless overridden with ``--max-tasks-per-child``). New
``invoice.paid`` events are posted in batches of ``--batch`` (signed just before they are sent)
by closed-loop senders; a sampler reads the RSS of every worker process (main and pool, from
``/proc/<pid>/status``) every ``--interval`` seconds with the number of emails received so far.

Reported: the peak of the sum over the worker's processes, and of the largest single process,
up to the ``--baseline``-th email and up to the ``--emails``-th; their ratio is the figure
compared with the goal. A pool process replaced (recycled) in between shows as a new pid. At the
end every event must have produced exactly one email and no dead letter.

    .venv/bin/python -m bench.worker_rss [--emails 10000 --baseline 1000 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fullstack import Backend, backend, emails_check, pipeline_expected, serving, stored
from bench.harness import ACCEPTED_BODY, load, paid_batch
from bench.report import Goal
from bench.run import (
    NO_LIMITS,
    FullStackOptions,
    owned_measure,
    run_config,
    stack_arguments,
    stack_fields,
    verdict,
)
from stack.process import Process

GOAL = 1.1  # peak RSS after ``emails`` / peak RSS after ``baseline``


@dataclass(frozen=True, kw_only=True)
class Options(FullStackOptions):
    emails: int
    baseline: int
    batch: int
    senders: int
    interval: float
    timeout: float
    max_tasks_per_child: int | None


@dataclass(frozen=True)
class Sample:
    seconds: float
    emails: int
    rss_kib: dict[int, int]  # by pid
    pss_kib: dict[int, int]  # by pid

    @property
    def total(self) -> int:
        return sum(self.rss_kib.values())

    @property
    def pss(self) -> int:
        return sum(self.pss_kib.values())

    @property
    def largest(self) -> int:
        return max(self.rss_kib.values(), default=0)


class Sampler:
    """Samples the workers' RSS on a thread until stopped (at most ``limit`` samples)."""

    def __init__(self, backend: Backend, interval: float, limit: int = 100_000) -> None:
        self.backend = backend
        self.interval = interval
        self.limit = limit
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.samples) < self.limit:
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        emails = self.backend.emails  # before the RSS: the figure is "after this many"
        rss, pss = self.backend.workers.rss(), self.backend.workers.pss()
        self.samples.append(Sample(time.perf_counter() - self._started, emails, rss, pss))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def peak_until(samples: Sequence[Sample], emails: int) -> dict[str, Any]:
    """Peak RSS over the samples taken until ``emails`` had arrived (the first sample at or
    past it included)."""
    taken: list[Sample] = []
    for sample in samples:
        taken.append(sample)
        if sample.emails >= emails:
            break
    return {
        "emails": emails,
        "samples": len(taken),
        "total_kib": max(sample.total for sample in taken),
        "largest_kib": max(sample.largest for sample in taken),
        "pss_kib": max(sample.pss for sample in taken),
        "pids": sorted({pid for sample in taken for pid in sample.rss_kib}),
    }


def post_all(backend: Backend, server: Process, options: Options) -> list[str]:
    """Post ``options.emails`` new paid invoices in batches; return their ids."""
    invoices: list[str] = []
    while len(invoices) < options.emails:
        count = min(options.batch, options.emails - len(invoices))
        batch = paid_batch(count, port=server.port, secret=backend.run.secret)
        result = load(
            port=server.port,
            requests=batch.requests,
            duration=options.timeout,
            concurrency=options.senders,
            expect=ACCEPTED_BODY,
            cycle=False,
        )
        invoices += batch.invoice_ids
        if result.errors or result.successes != count:
            raise RuntimeError(f"{result.successes} of {count} acknowledged: {result.errors}")
        print(f"  posted {len(invoices)}; {backend.emails} emails so far", flush=True)
    return invoices


def measure(options: Options, prefix: str) -> dict[str, Any]:
    run = run_config("worker_rss", prefix, options)
    settings = dict(NO_LIMITS)
    if options.max_tasks_per_child is not None:
        limit = {"CELERY_WORKER_MAX_TASKS_PER_CHILD": options.max_tasks_per_child}
        settings["BENCH_SETTINGS"] = json.dumps(limit)
    with backend(run, settings=settings) as stack, serving(stack) as server:
        with Sampler(stack, options.interval) as sampler:
            started = time.perf_counter()
            invoices = post_all(stack, server, options)
            stack.wait_emails(len(invoices), options.timeout)
            seconds = time.perf_counter() - started
            sampler.sample()  # one after the last email, whatever the interval
        time.sleep(2.0)  # room for a duplicate email, were there one
        found = stored(options.database_url)
        emails = emails_check(stack.sink, invoices)
    samples = sampler.samples
    at_baseline = peak_until(samples, options.baseline)
    at_end = peak_until(samples, options.emails)
    total = len(invoices)
    expected = pipeline_expected(total)
    goal = Goal(
        source="worker_rss",
        metric=f"worker peak RSS after {options.emails:,} ÷ after {options.baseline:,} emails",
        value=f"{at_end['total_kib'] / 1024:.1f} / {at_baseline['total_kib'] / 1024:.1f} MiB",
        measured=at_end["total_kib"] / at_baseline["total_kib"],
        op="<=",
        limit=GOAL,
    )
    return {
        "seconds": seconds,
        "emails_per_s": total / seconds,
        "at_baseline": at_baseline,
        "at_end": at_end,
        "largest_ratio": at_end["largest_kib"] / at_baseline["largest_kib"],
        "pss_ratio": at_end["pss_kib"] / at_baseline["pss_kib"],
        "trace": [
            {
                "s": round(s.seconds, 2),
                "emails": s.emails,
                "rss_kib": s.total,
                "pss_kib": s.pss,
                "rss_by_pid": s.rss_kib,
            }
            for s in samples
        ],
        "summary": [goal.as_dict()],
        "incidents": stack.incidents,
        "checks": {
            "expected": expected,
            "found": found,
            "sink": emails,
            "ok": found == expected and emails["ok"],
        },
    }


def report(options: Options, results: dict[str, Any]) -> str:
    base, end = results["at_baseline"], results["at_end"]
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.workers.describe()}; "
        f"{options.emails} emails in {results['seconds']:.0f} s "
        f"({results['emails_per_s']:.1f}/s); sampled every {options.interval:g} s",
        "",
        f"{'until email':>11} {'samples':>7} {'RSS sum MiB':>11} {'largest MiB':>11} "
        f"{'PSS sum MiB':>11} {'processes':>9}",
    ]
    for peak in (base, end):
        lines.append(
            f"{peak['emails']:>11} {peak['samples']:>7} {peak['total_kib'] / 1024:>11.1f} "
            f"{peak['largest_kib'] / 1024:>11.1f} {peak['pss_kib'] / 1024:>11.1f} "
            f"{len(peak['pids']):>9}"
        )
    lines += [
        f"ratios: largest single process {results['largest_ratio']:.3f}, "
        f"PSS sum {results['pss_ratio']:.3f} (processes seen: a recycled pool process is new)",
        "",
        *(Goal.from_dict(goal).line() for goal in results["summary"]),
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_rss", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--emails", type=int, default=10_000, help="emails in all")
    parser.add_argument("--baseline", type=int, default=1_000, help="the early peak's emails")
    parser.add_argument("--batch", type=int, default=1_000, help="events signed per batch")
    parser.add_argument("--senders", type=int, default=8, help="concurrent HTTP senders")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per step")
    parser.add_argument(
        "--max-tasks-per-child",
        type=int,
        default=None,
        help="override CELERY_WORKER_MAX_TASKS_PER_CHILD (application default: 5000)",
    )
    stack_arguments(parser, name="worker_rss")
    args = parser.parse_args(argv)
    if not 0 < args.baseline < args.emails:
        parser.error("need 0 < --baseline < --emails")
    return Options(
        emails=args.emails,
        baseline=args.baseline,
        batch=args.batch,
        senders=args.senders,
        interval=args.interval,
        timeout=args.timeout,
        max_tasks_per_child=args.max_tasks_per_child,
        **stack_fields(args),
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="worker_rss",
        config={
            "workers": options.workers.describe(),
            "emails": options.emails,
            "baseline": options.baseline,
            "senders": options.senders,
            "interval_s": options.interval,
            "max_tasks_per_child": options.max_tasks_per_child or "application default",
            "server_settings": NO_LIMITS,
        },
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results))
    return verdict(options, results["checks"])


if __name__ == "__main__":
    sys.exit(main())
