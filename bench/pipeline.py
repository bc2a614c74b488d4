"""End-to-end pipeline throughput: paid invoices pushed through webhook -> outbox -> Celery worker
-> SMTP, beside the version a Django team writes from the tutorials, the floor (the least work
any durable design must do for the same email) and a no-op Celery task, on the same broker,
pool and worker count, in one run, so the ratios are what the application's email costs
against each.

Four arms, interleaved over rounds, against one running stack (gunicorn, Celery workers started
as ``celery -A core worker``, an SMTP sink in this process):

* ``emails``: N new ``invoice.paid`` events, signed as Stripe signs them, posted to
  ``/webhooks/stripe/`` by closed-loop senders; the clock runs from the first post to the N-th
  email received by the sink. Each event is stored with its invoice and outbox row, published
  to Redis on commit, and emailed by ``invoicing.send_invoice_email``.
* ``tutorial``: N new ``invoice.paid`` events posted the same way to the tutorial's webhook
  (``bench/tutorial.py``, served by the same gunicorn: stripe-python's ``construct_event``,
  ``get_or_create``, ``update_or_create``, ``delay_on_commit``) and emailed by the tutorial's
  task (loaded into the same workers: ``autoretry_for``, ``retry_backoff``, Django's
  ``send_mail``). Its events give each invoice a recipient of its own, which names the invoice
  in the sink (its emails carry Django's own Message-ID);
* ``floor``: N new ``invoice.paid`` events posted the same way to the floor
  receiver (``bench/floor_receiver.py``, a second gunicorn of the same configuration) and
  emailed by the floor sender (``bench/floor_sender.py``, loaded into the same workers): the
  least work any design that commits before answering and sends each email once must do;
* ``noop``: N ``bench.noop`` tasks (``bench/tasks.py``: one Redis INCR) published from this
  process to the ``default`` queue as fast as one connection allows; the clock runs from the
  first publish to the N-th completion.

Goal: pipeline emails/s at least the tutorial's, the median of the rounds' rates (the
guarantees at no cost); the ratios to the floor's and to the no-op task rate are reported, not
goals. At the end: one invoice per event, exactly one email per invoice in the sink, one sent
email recorded for each of the application's and the floor's (the tutorial records none), no
dead letter, no unpublished outbox row (the floor receiver writes its rows published; the
tutorial has no outbox), nothing left in the broker's queues.

    .venv/bin/python -m bench.pipeline [--emails 2000 --rounds 2 --worker-concurrency 4 ...]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from bench.fullstack import (
    TUTORIAL_DOMAIN,
    Backend,
    backend,
    emails_check,
    noop_done,
    pipeline_expected,
    serving,
    stored,
)
from bench.harness import ACCEPTED_BODY, WEBHOOK_PATH, load, paid_batch
from bench.report import Goal
from bench.run import (
    NO_LIMITS,
    TUTORIAL_PATH,
    FullStackOptions,
    RunConfig,
    cpu_metered,
    cpu_per_item,
    floor_web,
    owned_measure,
    redis_queued,
    run_config,
    stack_arguments,
    stack_fields,
    verdict,
)
from bench.tasks import NOOP_TASK
from stack.process import Process

# The guarantees at no cost: at least the tutorial's emails/s, as the median of the rounds'
# rates (the arms interleaved). The floor's ratio is reported, not a goal.
TUTORIAL_GOAL = 1.0
ARMS = ("emails", "tutorial", "floor", "noop")


@dataclass(frozen=True, kw_only=True)
class Options(FullStackOptions):
    emails: int
    rounds: int
    senders: int
    warmup: int
    timeout: float


@dataclass(frozen=True)
class ArmRun:
    arm: str
    round: int
    items: int
    seconds: float  # first post or publish -> N-th email or completion
    submit_seconds: float  # first -> last post or publish
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def publisher(run: RunConfig) -> Celery:
    """A Celery app in this process that publishes to the run's broker and key prefix, as the
    project's app does (JSON; no results)."""
    app = Celery("bench-publisher", broker=run.redis_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": run.prefix},
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
    )
    return app


class Pipeline:
    def __init__(
        self, *, backend: Backend, server: Process, floor: Process, options: Options
    ) -> None:
        self.backend = backend
        self.server = server
        self.floor = floor
        self.options = options
        self.app = publisher(backend.run)
        self.invoices: list[str] = []  # every invoice posted, warm-up included
        self.tutorial_invoices = 0  # of which posted to the tutorial's webhook
        self.noops = 0  # every no-op published

    def server_of(self, arm: str) -> Process:
        return self.floor if arm == "floor" else self.server

    def post(self, count: int, *, arm: str) -> tuple[float, float]:
        """Post ``count`` new paid invoices to ``arm``'s webhook; return the times
        (``time.time()``, as the SMTP server records each email) of the first post and of the
        last response. Every one must be acknowledged as new."""
        server = self.server_of(arm)
        tutorial = arm == "tutorial"
        batch = paid_batch(
            count,
            port=server.port,
            secret=self.backend.run.secret,
            path=TUTORIAL_PATH if tutorial else WEBHOOK_PATH,
            recipients=TUTORIAL_DOMAIN if tutorial else "",
        )
        started = time.time()
        result = load(
            port=server.port,
            requests=batch.requests,
            duration=self.options.timeout,
            concurrency=self.options.senders,
            expect=ACCEPTED_BODY,
            cycle=False,
        )
        posted = time.time()
        self.invoices += batch.invoice_ids
        self.tutorial_invoices += count if tutorial else 0
        if result.errors or result.successes != count:
            raise RuntimeError(
                f"{result.successes} of {count} posts acknowledged: {dict(result.errors)}"
            )
        return started, posted

    def publish(self, count: int) -> tuple[float, float]:
        started = time.time()
        with self.app.producer_or_acquire() as producer:
            for _ in range(count):
                self.app.send_task(NOOP_TASK, queue="default", producer=producer)
        self.noops += count
        return started, time.time()

    def wait_emails(self, total: int) -> float:
        """Wait for the ``total``-th email; when the SMTP server took it."""
        self.backend.wait_emails(total, self.options.timeout)
        return self.backend.sink.handler.received()[total - 1].at

    def wait_noops(self, total: int) -> float:
        deadline = time.time() + self.options.timeout
        while noop_done(self.backend.redis, self.backend.run.prefix) < total:
            if time.time() > deadline:
                self.backend.workers.check()
                raise RuntimeError(f"no-op tasks not all done after {self.options.timeout:.0f} s")
            time.sleep(0.005)
        return time.time()

    def warm_up(self) -> None:
        count = self.options.warmup
        for arm in ("emails", "tutorial", "floor"):
            self.post(count, arm=arm)
            self.wait_emails(len(self.invoices))
        self.publish(count)
        self.wait_noops(self.noops)

    def run(self, arm: str, round_: int) -> ArmRun:
        count = self.options.emails
        server = self.server_of(arm)
        with cpu_metered(lambda: self.backend.cpu_groups(server)) as cpu:
            if arm != "noop":
                started, submitted = self.post(count, arm=arm)
                finished = self.wait_emails(len(self.invoices))
            else:
                started, submitted = self.publish(count)
                finished = self.wait_noops(self.noops)
        return ArmRun(
            arm=arm,
            round=round_,
            items=count,
            seconds=finished - started,
            submit_seconds=submitted - started,
            cpu=cpu,
        )


def summarize(runs: Sequence[ArmRun]) -> dict[str, Any]:
    items = sum(run.items for run in runs)
    seconds = sum(run.seconds for run in runs)
    cpu = {group: sum(run.cpu[group] for run in runs) for group in runs[0].cpu}
    return {
        "items": items,
        "seconds": round(seconds, 3),
        "rate": items / seconds,
        "round_rates": [round(run.rate, 1) for run in runs],
        "submit_rate": items / sum(run.submit_seconds for run in runs),
        "cpu_ms_per_item": cpu_per_item(cpu, items),
        "machine_busy": cpu["all"] / (seconds * (os.cpu_count() or 1)) if seconds else math.nan,
    }


def own_cpu(arm: dict[str, Any]) -> float:
    """CPU ms per item of the stack's own processes (load generator and sink included; the
    kernel's own work and other users' processes, ``other``, excluded)."""
    cpu = arm["cpu_ms_per_item"]
    return float(sum(ms for group, ms in cpu.items() if group not in ("other", "all")))


def goals(arms: dict[str, dict[str, Any]]) -> list[Goal]:
    """The application's emails/s against the tutorial's, the median of the rounds' rates (with
    the worker's CPU per email of each)."""
    emails, tutorial = arms["emails"], arms["tutorial"]
    ours, theirs = (statistics.median(arm["round_rates"]) for arm in (emails, tutorial))
    return [
        Goal(
            source="pipeline",
            metric="pipeline emails/s ÷ tutorial emails/s, median of the rounds "
            "(worker CPU ms per email)",
            value=f"{ours:.1f} / {theirs:.1f} per s, {len(emails['round_rates'])} rounds "
            f"({emails['cpu_ms_per_item']['celery']:.2f} / "
            f"{tutorial['cpu_ms_per_item']['celery']:.2f} ms)",
            measured=ours / theirs,
            op=">=",
            limit=TUTORIAL_GOAL,
        )
    ]


def checks(pipeline: Pipeline, options: Options) -> dict[str, Any]:
    """After a pause for any duplicate email to arrive: one invoice and one email in the sink
    per event, one sent email recorded for each but the tutorial's; no dead letter; the
    broker's queues empty."""
    time.sleep(2.0)
    found = stored(options.database_url)
    expected = pipeline_expected(len(pipeline.invoices) - pipeline.tutorial_invoices)
    expected["events"] = expected["invoices"] = len(pipeline.invoices)
    emails = emails_check(pipeline.backend.sink, pipeline.invoices)
    noops = noop_done(pipeline.backend.redis, pipeline.backend.run.prefix)
    queued = redis_queued(url=options.redis_url, prefix=pipeline.backend.run.prefix)
    ok = found == expected and emails["ok"] and noops == pipeline.noops and queued == 0
    return {
        "expected": expected,
        "found": found,
        "sink": emails,
        "noop_tasks": {"published": pipeline.noops, "done": noops},
        "broker_messages_left": queued,
        "ok": ok,
    }


def measure(options: Options, prefix: str) -> dict[str, Any]:
    run = run_config("pipeline", prefix, options)
    runs: list[ArmRun] = []
    with (
        backend(run, settings=NO_LIMITS) as stack,
        serving(stack) as server,
        floor_web(stack.env, run.gunicorn, log=run.name) as floor,
    ):
        pipeline = Pipeline(backend=stack, server=server, floor=floor, options=options)
        pipeline.warm_up()
        print(
            f"warmed up ({options.warmup} emails, {options.warmup} tutorial, "
            f"{options.warmup} floor, {options.warmup} no-ops); "
            f"{options.rounds} round(s) of {options.emails}",
            flush=True,
        )
        for round_ in range(options.rounds):
            order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
            for arm in order:
                result = pipeline.run(arm, round_)
                runs.append(result)
                print(
                    f"  round {round_ + 1} {arm:<6} {result.rate:7.1f}/s end to end "
                    f"({result.seconds:.2f} s; submitted in {result.submit_seconds:.2f} s)",
                    flush=True,
                )
        stored_checks = checks(pipeline, options)
    arms = {arm: summarize([r for r in runs if r.arm == arm]) for arm in ARMS}
    return {
        "arms": arms,
        "cpu_ratio": own_cpu(arms["noop"]) / own_cpu(arms["emails"]),
        "floor_cpu_ratio": own_cpu(arms["floor"]) / own_cpu(arms["emails"]),
        "tutorial_cpu_ratio": own_cpu(arms["tutorial"]) / own_cpu(arms["emails"]),
        "runs": [
            {"arm": r.arm, "round": r.round, "rate": r.rate, "seconds": r.seconds} for r in runs
        ],
        "summary": [goal.as_dict() for goal in goals(arms)],
        "checks": stored_checks,
        "incidents": stack.incidents,
    }


def report(options: Options, results: dict[str, Any]) -> str:
    arms = results["arms"]
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.workers.describe()}; "
        f"{options.senders} HTTP senders; {options.rounds} round(s) x {options.emails} per arm",
        "",
        f"{'arm':<8} {'items':>7} {'seconds':>8} {'per s':>7} {'submit/s':>9}  per-round /s",
    ]
    for arm, s in arms.items():
        rounds = " ".join(f"{rate:.1f}" for rate in s["round_rates"])
        lines.append(
            f"{arm:<8} {s['items']:>7} {s['seconds']:>8.2f} {s['rate']:>7.1f} "
            f"{s['submit_rate']:>9.1f}  {rounds}"
        )
    groups = list(arms["emails"]["cpu_ms_per_item"])
    lines += ["", "CPU ms per item " + " ".join(f"{g:>9}" for g in groups) + "   busy"]
    for arm, s in arms.items():
        cpu = s["cpu_ms_per_item"]
        figures = " ".join(f"{cpu[g]:>9.2f}" for g in groups)
        lines.append(f"  {arm:<13} {figures}  {s['machine_busy']:>5.0%}")
    lines += [
        "",
        f"by CPU of the stack's own processes: {own_cpu(arms['emails']):.2f} ms per email, "
        f"{own_cpu(arms['noop']):.2f} ms per no-op: ratio {results['cpu_ratio']:.2f} "
        "(what the rates' ratio would be if both were CPU-bound, without the neighbours); "
        f"{own_cpu(arms['tutorial']):.2f} ms per tutorial email: "
        f"ratio {results['tutorial_cpu_ratio']:.2f}; "
        f"{own_cpu(arms['floor']):.2f} ms per floor email: ratio {results['floor_cpu_ratio']:.2f}",
        f"emails/s ÷ no-op tasks/s: {arms['emails']['rate'] / arms['noop']['rate']:.2f}",
        "",
    ]
    lines += [Goal.from_dict(goal).line() for goal in results["summary"]]
    return "\n".join(lines)


def arguments(parser: argparse.ArgumentParser, *, name: str, emails: int, arm: str) -> None:
    """The options of a benchmark of emails through the pipeline (this one, ``bench.brokers``):
    ``emails`` per ``arm`` and round by default."""
    parser.add_argument("--emails", type=int, default=emails, help=f"invoices per {arm}")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the arms")
    parser.add_argument("--senders", type=int, default=8, help="concurrent HTTP senders")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured items before")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per arm")
    stack_arguments(parser, name=name)


def options_from(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, pool: str = "prefork"
) -> Options:
    if args.emails < 1 or args.rounds < 1:
        parser.error("--emails and --rounds must be positive")
    return Options(
        emails=args.emails,
        rounds=args.rounds,
        senders=args.senders,
        warmup=args.warmup,
        timeout=args.timeout,
        **stack_fields(args, pool=pool),
    )


def config(options: Options) -> dict[str, Any]:
    """What the results file records of the run's shape."""
    return {
        "workers": options.workers.describe(),
        "senders": options.senders,
        "emails_per_arm": options.emails,
        "rounds": options.rounds,
        "warmup": options.warmup,
        "server_settings": NO_LIMITS,
    }


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0]
    )
    arguments(parser, name="pipeline", emails=2000, arm="arm (and no-ops)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    args = parser.parse_args(argv)
    return options_from(parser, args, pool=args.pool)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="pipeline",
        config=config(options),
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results))
    print(f"no-op tasks {results['checks']['noop_tasks']}")
    return verdict(options, results["checks"])


if __name__ == "__main__":
    sys.exit(main())
