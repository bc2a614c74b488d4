"""Redis and RabbitMQ as the Celery broker, measured in one run: the same paid invoices through
the whole pipeline (webhook -> outbox -> published on commit -> worker -> SMTP) on two stacks
side by side, identical but for the broker, their arms interleaved over rounds, so the ratio
is the one broker's cost over the other's on the same machine at the same time.

* ``redis``: the benchmarks' Redis (the machine's, the run's own key prefix), broker and cache.
* ``rabbitmq``: a RabbitMQ node of the run's own (``stack.rabbitmq.RabbitNode``: its own node
  name, ports and data directory, removed at the end), with the queues the application
  declares there (durable quorum queues, publisher confirms); Redis stays the cache.

Both stacks share the benchmark database and the shape of ``bench.pipeline`` (gunicorn, one
Celery worker of four prefork processes, an SMTP sink each): each round posts N new
``invoice.paid`` events to one stack and waits for its N-th email, then the other. Printed per
broker: emails/s end to end, webhooks acknowledged/s while the workers drain, and CPU ms per
email of gunicorn, the worker, PostgreSQL and each broker's processes (the RabbitMQ node's are
the run's alone; Redis is the machine's, shared with whoever else uses it). At the end: one
invoice, one sent email and one email in its sink per event, and no message left in either
broker.

    .venv/bin/python -m bench.brokers [--emails 1000 --rounds 2 --worker-concurrency 4 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from bench.fullstack import backend, emails_check, pipeline_expected, serving, stored
from bench.pipeline import ArmRun, Options, Pipeline, arguments, config, options_from, summarize
from bench.run import (
    NO_LIMITS,
    owned_measure,
    redis_prefix_delete,
    redis_queued,
    run_config,
    verdict,
)
from stack.rabbitmq import RabbitNode

BROKERS = ("redis", "rabbitmq")


@contextlib.contextmanager
def rabbit_node(name: str) -> Iterator[RabbitNode]:
    """A RabbitMQ node of the run's own, started; removed (with its data) on the way out."""
    node = RabbitNode(name=name)
    try:
        node.start()
        yield node
    finally:
        node.remove()


def rabbit_messages(node: RabbitNode) -> int:
    """Messages in every queue of the node, ready or unacknowledged."""
    output = node.ctl("list_queues", "--quiet", "--no-table-headers", "name", "messages")
    return sum(int(line.split()[-1]) for line in output.splitlines() if line.strip())


def _node_pids(node: RabbitNode) -> list[int]:
    return node.process.pids() if node.process is not None else []


def checks(pipelines: dict[str, Pipeline], node: RabbitNode, options: Options) -> dict[str, Any]:
    """One invoice and one sent email per event in the shared database; exactly one email
    per invoice in each broker's sink; nothing left in either broker."""
    invoices = [i for pipeline in pipelines.values() for i in pipeline.invoices]
    found = stored(options.database_url)
    expected = pipeline_expected(len(invoices))
    sinks = {
        broker: emails_check(pipeline.backend.sink, pipeline.invoices)
        for broker, pipeline in pipelines.items()
    }
    left = {
        "redis": redis_queued(url=options.redis_url, prefix=pipelines["redis"].backend.run.prefix),
        "rabbitmq": rabbit_messages(node),
    }
    ok = found == expected and all(s["ok"] for s in sinks.values()) and not any(left.values())
    return {
        "expected": expected,
        "found": found,
        "sink": sinks,
        "broker_messages_left": left,
        "ok": ok,
    }


def measure(options: Options, prefix: str) -> dict[str, Any]:
    runs: list[ArmRun] = []
    with contextlib.ExitStack() as stack, rabbit_node(prefix.rstrip(":")) as node:
        pipelines: dict[str, Pipeline] = {}
        for broker in BROKERS:
            # A key prefix (and worker names) of each stack's own, deleted at the end.
            own = f"{prefix.rstrip(':')}-{broker}:"
            stack.callback(redis_prefix_delete, url=options.redis_url, prefix=own)
            run = run_config(f"brokers-{broker}", own, options)
            if broker == "rabbitmq":
                run = replace(run, broker_url=node.url)
            ends = stack.enter_context(backend(run, settings=NO_LIMITS))
            server = stack.enter_context(serving(ends))
            # Both brokers' processes in every arm: the idle one costs little.
            ends.brokers["rabbitmq"] = lambda: _node_pids(node)
            pipelines[broker] = Pipeline(backend=ends, server=server, floor=server, options=options)
        for pipeline in pipelines.values():
            pipeline.post(options.warmup, arm="emails")
            pipeline.wait_emails(len(pipeline.invoices))
        print(
            f"warmed up ({options.warmup} emails each); "
            f"{options.rounds} round(s) of {options.emails}",
            flush=True,
        )
        for round_ in range(options.rounds):
            order = BROKERS if round_ % 2 == 0 else BROKERS[::-1]
            for broker in order:
                result = replace(pipelines[broker].run("emails", round_), arm=broker)
                runs.append(result)
                print(
                    f"  round {round_ + 1} {broker:<8} {result.rate:7.1f} emails/s end to end "
                    f"({result.seconds:.2f} s; posted in {result.submit_seconds:.2f} s)",
                    flush=True,
                )
        stored_checks = checks(pipelines, node, options)
        incidents = [i for p in pipelines.values() for i in p.backend.incidents]
    arms = {broker: summarize([r for r in runs if r.arm == broker]) for broker in BROKERS}
    return {
        "arms": arms,
        "runs": [
            {"arm": r.arm, "round": r.round, "rate": r.rate, "seconds": r.seconds} for r in runs
        ],
        "checks": stored_checks,
        "incidents": incidents,
    }


def report(options: Options, results: dict[str, Any]) -> str:
    arms = results["arms"]
    lines = [
        f"gunicorn {options.gunicorn.describe()}; {options.workers.describe()}; "
        f"{options.senders} HTTP senders; {options.rounds} round(s) x {options.emails} per broker",
        "",
        f"{'broker':<9} {'emails':>7} {'seconds':>8} {'emails/s':>9} {'webhooks/s':>11}  "
        "per-round emails/s",
    ]
    for broker, s in arms.items():
        rounds = " ".join(f"{rate:.1f}" for rate in s["round_rates"])
        lines.append(
            f"{broker:<9} {s['items']:>7} {s['seconds']:>8.2f} {s['rate']:>9.1f} "
            f"{s['submit_rate']:>11.1f}  {rounds}"
        )
    groups = [g for g in arms["redis"]["cpu_ms_per_item"] if g not in ("other", "all")]
    lines += ["", "CPU ms per email " + " ".join(f"{g:>9}" for g in groups) + "   busy"]
    for broker, s in arms.items():
        cpu = s["cpu_ms_per_item"]
        lines.append(
            f"  {broker:<14} "
            + " ".join(f"{cpu[g]:>9.2f}" for g in groups)
            + f"  {s['machine_busy']:>5.0%}"
        )
    redis_arm, rabbit = arms["redis"], arms["rabbitmq"]
    lines += [
        "",
        f"RabbitMQ ÷ Redis: emails/s {rabbit['rate'] / redis_arm['rate']:.2f}, "
        f"webhooks/s {rabbit['submit_rate'] / redis_arm['submit_rate']:.2f}, "
        f"worker CPU per email {rabbit['cpu_ms_per_item']['celery'] / redis_arm['cpu_ms_per_item']['celery']:.2f}, "  # noqa: E501
        f"gunicorn CPU per webhook {rabbit['cpu_ms_per_item']['gunicorn'] / redis_arm['cpu_ms_per_item']['gunicorn']:.2f}",  # noqa: E501
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.brokers", description=__doc__.split("\n\n")[0]
    )
    arguments(parser, name="brokers", emails=1000, arm="broker per round")
    return options_from(parser, parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    results = owned_measure(
        options,
        measure,
        benchmark="brokers",
        config=config(options),
    )
    if isinstance(results, int):
        return results
    print()
    print(report(options, results))
    return verdict(options, results["checks"])


if __name__ == "__main__":
    sys.exit(main())
