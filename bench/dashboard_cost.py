"""What the operator's dashboard (``/admin/dashboard/``) costs per render, and each probe in it.

A database of its own is filled with a realistic day: ``--invoices`` paid invoices (10,000), a
payment email for each (sent over the last three days, a few failed or being sent), one resend
per 20 invoices, a job per email (finished, failed or running as its email is) and a small
unpublished backlog, dead letters (waiting and replayed, of every reason), every scheduled
job's record, and the email breaker's state in Redis. Then gunicorn serves the application as
in production (one sync worker, ``DJANGO_DEBUG=0``) and a staff user of the "viewers" group GETs
the dashboard ``--renders`` times (after ``--warmup`` unmeasured ones).

Reported: the whole request (loopback HTTP, session, the probes, the template) and the probes
alone, as the page itself reports them (per probe and in all): median, p95 and max, in ms.

    .venv/bin/python -m bench.dashboard_cost [--invoices 10000 --renders 50]

The database (``invoicing_bench_dashboard``, dropped and recreated) and the Redis keys (database
13, a prefix of the run's own, deleted at the end) are the benchmark's own.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import requests

from bench.report import machine, results_write
from bench.run import database_exclusive, database_recreate, redis_prefix_delete
from stack import launch
from stack.process import ROOT

RESULTS = ROOT / "bench" / "results"
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/invoicing_bench_dashboard"
REDIS_URL = "redis://127.0.0.1:6379/13"
PREFIX = f"bench-dashboard-{secrets.token_hex(4)}:"
ENV = {
    "DJANGO_SETTINGS_MODULE": "core.settings",
    "DJANGO_DEBUG": "0",
    "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
    "STRIPE_WEBHOOK_SECRET": f"whsec_bench_{secrets.token_hex(16)}",
    "DJANGO_SECURE_SSL_REDIRECT": "0",  # plain HTTP on loopback
    "DATABASE_URL": DATABASE_URL,
    "CELERY_BROKER_URL": REDIS_URL,
    "CELERY_BROKER_KEY_PREFIX": PREFIX,
    "REDIS_URL": REDIS_URL,
    "REDIS_KEY_PREFIX": PREFIX.rstrip(":"),
    "LOG_LEVEL": "WARNING",
}


def fill(invoices: int) -> dict[str, int]:
    """The day's rows, written in bulk; returns what was written."""
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from asyncwork.contrib.periodic.jobs import jobs_declared
    from asyncwork.models import DeadLetter, Job, ScheduledJob
    from invoicing.models import EmailDelivery, Invoice
    from invoicing.tasks import email_breaker, send_invoice_email

    now = timezone.now()
    Invoice.objects.bulk_create(
        (
            Invoice(
                provider_invoice_id=f"in_bench_{n}",
                number=f"INV-{n:06d}",
                customer_email=f"customer{n}@example.com",
                customer_name=f"Customer {n}",
                amount_paid=2000,
                currency="usd",
                status="paid",
                paid_at=now - timedelta(seconds=n * 259200 // invoices),
                provider_updated_at=now,
            )
            for n in range(invoices)
        ),
        batch_size=2000,
    )
    ids = list(Invoice.objects.order_by("pk").values_list("pk", flat=True))

    def state(n: int) -> str:
        return "failed" if n % 200 == 0 else "sending" if n % 500 == 1 else "sent"

    EmailDelivery.objects.bulk_create(
        (
            EmailDelivery(
                key=f"invoice_email_sent:{pk}",
                invoice_id=pk,
                state=state(n),
                attempts=1 + n % 3,
                message_id=f"<in_bench_{n}.{pk}@example.com>",
                sent_at=now - timedelta(seconds=n * 259200 // invoices)
                if state(n) == "sent"
                else None,
                last_error="SMTP 451 4.3.0 try later" if state(n) == "failed" else "",
            )
            for n, pk in enumerate(ids)
        ),
        batch_size=2000,
    )
    EmailDelivery.objects.bulk_create(
        (
            EmailDelivery(
                key=f"invoice_email_resend:{pk}:{n:032x}",
                invoice_id=pk,
                state="sent",
                attempts=1,
                message_id=f"<resend.{pk}@example.com>",
                sent_at=now - timedelta(hours=n % 72),
                requested_by="admin:op",
            )
            for n, pk in enumerate(ids[::20])
        ),
        batch_size=2000,
    )
    task = send_invoice_email.module_path
    job_status = {"sent": "SUCCESSFUL", "failed": "FAILED", "sending": "RUNNING"}
    Job.objects.bulk_create(
        (
            Job(
                task=task,
                args=[pk],
                queue="email",
                status=job_status[state(n)],
                published_at=now,
                publish_attempts=1,
                attempts=1,
                finished_at=None if state(n) == "sending" else now,
            )
            for n, pk in enumerate(ids)
        ),
        batch_size=2000,
    )
    Job.objects.bulk_create(Job(task=task, args=[pk], queue="email") for pk in ids[:25])
    reasons = [r.value for r in DeadLetter.Reason]
    DeadLetter.objects.bulk_create(
        DeadLetter(
            task=task,
            task_id=f"bench-{n}",
            args=[pk],
            queue="email",
            reason=reasons[n % len(reasons)],
            exception_class="asyncwork.errors.PermanentError",
            exception_message=f"recipient refused: 550 5.1.1 mailbox unavailable (c{n}@x.com)",
            attempts=1,
            first_failed_at=now,
            last_failed_at=now,
            replayed_at=now if n % 2 else None,
            replayed_by="admin:op" if n % 2 else "",
        )
        for n, pk in enumerate(ids[::100])
    )
    ScheduledJob.objects.bulk_create(  # migrate gives each job its row already
        (
            ScheduledJob(name=s.name, runs=100, last_started_at=now, last_finished_at=now)
            for s in jobs_declared()
        ),
        update_conflicts=True,
        unique_fields=["name"],
        update_fields=["runs", "last_started_at", "last_finished_at"],
    )
    breaker = email_breaker()
    breaker.reset()
    breaker.record_failure()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
    call_command("setup_groups", verbosity=0)
    return {
        "invoices": len(ids),
        "email_deliveries": EmailDelivery.objects.count(),
        "outbox_messages": Job.objects.count(),
        "dead_letters": DeadLetter.objects.count(),
        "waiting": DeadLetter.objects.filter(replayed_at__isnull=True).count(),
    }


def viewer_session() -> str:
    """A session cookie for a staff user in the "viewers" group."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.test import Client

    user = get_user_model().objects.create_user("bench-viewer", is_staff=True)
    user.groups.add(Group.objects.get(name="viewers"))
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


_PROBE = re.compile(r'id="probe-(\w+)">.*?<span class="ms">([\d.]+) ms</span>', re.DOTALL)
_ALL = re.compile(r"([\d.]+) ms in all")


def summary(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median": round(statistics.median(ordered), 2),
        "p95": round(ordered[max(0, round(0.95 * len(ordered)) - 1)], 2),
        "max": round(ordered[-1], 2),
    }


def measure(*, port: int, cookie: str, renders: int, warmup: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/admin/dashboard/"
    session = requests.Session()
    session.cookies.set("sessionid", cookie)
    total: list[float] = []
    probes_all: list[float] = []
    per_probe: dict[str, list[float]] = {}
    for i in range(warmup + renders):
        started = time.perf_counter()
        response = session.get(url, timeout=30)
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code != 200 or "could not be read" in response.text:
            raise RuntimeError(f"render {i}: {response.status_code} {response.text[:500]}")
        if i < warmup:
            continue
        total.append(elapsed)
        probes_all.append(float(_ALL.findall(response.text)[0]))
        for name, ms in _PROBE.findall(response.text):
            per_probe.setdefault(name, []).append(float(ms))
    return {
        "render_ms": summary(total),
        "probes_ms": summary(probes_all),
        "per_probe_ms": {name: summary(values) for name, values in per_probe.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dashboard_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--invoices", type=int, default=10_000)
    parser.add_argument("--renders", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    options = parser.parse_args(argv)

    os.environ.update(ENV)
    begun = time.time()
    host = machine(postgres_url=DATABASE_URL, redis_url=REDIS_URL)
    with database_exclusive(url=DATABASE_URL):
        print(f"recreating {DATABASE_URL} ...", flush=True)
        database_recreate(url=DATABASE_URL)
        import django

        django.setup()
        try:
            started = time.monotonic()
            rows = fill(options.invoices)
            print(f"filled in {time.monotonic() - started:.1f} s: {rows}", flush=True)
            cookie = viewer_session()
            with launch.gunicorn(
                {**os.environ, **ENV},
                config=launch.GunicornConfig(workers=1),
                log=RESULTS / "dashboard_cost.gunicorn.log",
            ) as server:
                result = measure(
                    port=server.port,
                    cookie=cookie,
                    renders=options.renders,
                    warmup=options.warmup,
                )
        finally:
            redis_prefix_delete(url=REDIS_URL, prefix=PREFIX)
    out = RESULTS / f"dashboard_cost_{options.invoices}.json"
    results_write(
        out,
        benchmark="dashboard_cost",
        started=begun,
        config={"invoices": options.invoices, "renders": options.renders, "gunicorn": "sync x 1"},
        results={"rows": rows, **result},
        host=host,
    )
    print(f"\n{'':<22}{'median':>9}{'p95':>9}{'max':>9}  (ms, {options.renders} renders)")
    lines = [("whole render (HTTP)", result["render_ms"]), ("probes, in all", result["probes_ms"])]
    lines += [(f"  {name}", figures) for name, figures in result["per_probe_ms"].items()]
    for label, figures in lines:
        print(f"{label:<22}{figures['median']:>9}{figures['p95']:>9}{figures['max']:>9}")
    print(f"\nwritten to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
