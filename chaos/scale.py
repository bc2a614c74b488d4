"""Scale across hosts: ``python -m chaos --hosts --scale``.

The hosts of ``chaos.hosts`` without faults: for each number of worker hosts (1, 2, 3) and
web hosts (1, 2), start that many workers (one a host) and gunicorns (one a host) on one
PostgreSQL and Redis (the data host), behind the nginx edge (``chaos.hosts.behind_edge``),
send a fresh batch of paid invoices as fast as the
senders can, and measure:

* webhooks/s: deliveries acknowledged with a 2xx / seconds from the first send to the last
  answer;
* emails/s: messages the SMTP server accepted / seconds from the first send to the last
  message accepted (end to end: ingest, outbox, broker, worker, SMTP);
* CPU ms per invoice: the user and system CPU time the stack spent (every process in the
  data, web and worker hosts' namespaces, read from /proc before and after the batch) /
  invoices emailed. The load generator and the SMTP server (on the control and mail hosts)
  are not counted.

On a machine of 2 cores throughput cannot grow much with hosts; what must hold is a flat
cost per item as hosts are added (no new contention). The table is printed and written to
``<results>/hosts-scale.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from chaos import config, hosts
from chaos.load import Sender, plan_build
from chaos.stack import Stack
from stack.machine import describe, revision
from stack.net import HOST
from stack.netns import Topology, ip
from stack.smtp import Faults, SmtpServer

WORKERS = (1, 2, 3)
WEBS = (1, 2)
REFUSED = "refused.example.com"
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(net: Topology, host_names: tuple[str, ...]) -> float:
    """User + system CPU seconds of every live process on ``host_names`` (and of the children
    they have reaped)."""
    total = 0
    for host in host_names:
        for pid in ip("netns", "pids", net.ns(host)).split():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                # after the command: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
                total += sum(int(f) for f in fields[11:15])
    return total / _TICKS


def _one(
    *,
    stack: Stack,
    net: Topology,
    smtp: SmtpServer,
    secret: str,
    workers: int,
    webs: int,
    invoices: int,
    rng: random.Random,
) -> dict[str, Any]:
    measured = (hosts.DATA_HOST, *hosts.WEB_HOSTS, *hosts.WORKER_HOSTS)
    with contextlib.ExitStack() as running:
        for index in range(workers):
            host = hosts.WORKER_HOSTS[index]
            worker = stack.start_worker(
                f"scale-{workers}w{webs}-{host}",
                concurrency=2,
                settings_module="chaos.settings",
                host=host,
            )
            running.callback(worker.stop)
        edge = running.enter_context(
            hosts.behind_edge(stack, web_hosts=hosts.WEB_HOSTS[:webs], workers=2)
        )
        targets = [(HOST, edge)]
        plan = plan_build(invoices=invoices, rng=rng, refused_domain=REFUSED)
        expected = len(smtp.handler.received()) + invoices - len(plan.refused)
        sender = Sender(
            targets=targets,
            secret=secret,
            plan=plan,
            senders=16,
            rate=10_000,
            seed=rng.getrandbits(32),
        )
        cpu_before = _cpu_seconds(net, measured)
        sender.run()
        emailed = smtp.handler.wait_for(expected, timeout=300)
        received = smtp.handler.received()
        cpu = _cpu_seconds(net, measured) - cpu_before
    acked = sender.responses.by_status.get("200", 0) + sender.responses.by_status.get("202", 0)
    last_email = max(r.at for r in received)
    emails = invoices - len(plan.refused)
    return {
        "worker_hosts": workers,
        "web_hosts": webs,
        "invoices": invoices,
        "deliveries": len(plan.deliveries),
        "webhooks_per_second": round(acked / (sender.ended - sender.started), 1),
        "emails_per_second": round(emails / (last_email - sender.started), 1),
        "all_emailed": emailed,
        "cpu_ms_per_invoice": round(1000 * cpu / invoices, 1),
        "responses_by_status": dict(sender.responses.by_status),
    }


def run(*, results: Path, invoices: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible plan, not secrets
    log_dir = results / "logs" / "scale"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    with hosts.topology() as net, net.inside(hosts.CTL):
        smtp = SmtpServer(faults=Faults(refuse_domain=REFUSED), host=net.address(hosts.MAIL))
        with net.inside(hosts.MAIL):
            smtp.start()
        env = config.app_env(
            smtp_port=smtp.port,
            smtp_host=smtp.host,
            web_hosts=(HOST, *(net.address(h) for h in hosts.WEB_HOSTS)),
        )
        try:
            with Stack(log_dir=log_dir, app_env=env, net=net) as stack:
                assert stack.postgres is not None
                stack.postgres.create_database("chaos")
                stack.manage("migrate", "--noinput")
                for workers in WORKERS:
                    for webs in WEBS:
                        row = _one(
                            stack=stack,
                            net=net,
                            smtp=smtp,
                            secret=env["STRIPE_WEBHOOK_SECRET"],
                            workers=workers,
                            webs=webs,
                            invoices=invoices,
                            rng=rng,
                        )
                        print(_line(row), flush=True)
                        rows.append(row)
        finally:
            smtp.stop()
    document = {
        "kind": "chaos-hosts-scale",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_seconds": round(time.time() - started, 1),
        "machine": describe(),
        "revision": revision(),
        "seed": seed,
        "invoices_per_row": invoices,
        "definitions": {
            "webhooks_per_second": "deliveries answered 2xx / seconds from the first send to "
            "the last answer (16 senders, unpaced)",
            "emails_per_second": "emails accepted by the SMTP server / seconds from the first "
            "send to the last message accepted",
            "cpu_ms_per_invoice": "user + system CPU of every process on the data, web and "
            "worker hosts over the batch / invoices (their deliveries and their email)",
        },
        "rows": rows,
    }
    path = results / "hosts-scale.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"result file: {path}", flush=True)
    return document


def _line(row: dict[str, Any]) -> str:
    return (
        f"| {row['worker_hosts']} | {row['web_hosts']} | {row['webhooks_per_second']} | "
        f"{row['emails_per_second']} | {row['cpu_ms_per_invoice']} |"
    )


def table(document: dict[str, Any]) -> str:
    head = (
        "| worker hosts | web hosts | webhooks/s | emails/s | stack CPU ms per invoice |\n"
        "|---|---|---|---|---|"
    )
    return "\n".join([head, *(_line(r) for r in document["rows"])])
