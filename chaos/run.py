"""One arm of the chaos suite, end to end.

1. Start the arm's own PostgreSQL and Redis (``chaos.stack``), migrate, sync the periodic
   tasks, then shorten the dead-letter alert's interval in the database.
2. Start the fault-injecting SMTP server, the workers (the control arm's with at-least-once
   off, ``chaos.unsafe_settings``, and a poll that only relays, ``chaos.unsafe_celery``), beat
   and gunicorn.
3. Send the load while the fault plan runs; run the plan's post-load faults.
4. Wait for quiescence (``quiesce``), read the database's account, stop everything, and build
   the report (``chaos.report``).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chaos import config, hosts, report
from chaos.faults import RABBITMQ_RESTART, REDIS_RESTART, Context, FaultRunner
from chaos.load import Plan, Sender, plan_build
from chaos.observe import (
    EMAIL_TASK,
    Broker,
    Db,
    RabbitBroker,
    Sources,
    Timeline,
    facts_collect,
    net_actions,
    worker_failed_acks,
    worker_outcomes,
    worker_self_terminations,
)
from chaos.stack import RABBITMQ, REDIS, Stack, WorkerPool
from stack import netns
from stack.net import HOST
from stack.netns import Topology
from stack.smtp import SmtpServer

_DEAD_LETTER_INVOICES_SQL = f"""
SELECT i.provider_invoice_id FROM asyncwork_deadletter l
JOIN invoicing_invoice i ON l.args = jsonb_build_array(i.id)
WHERE l.task = '{EMAIL_TASK}'
"""  # noqa: S608 - no input: a constant
# The jobs' statuses (RUNNING, READY...) and how many are published: what moves while the
# pipeline works.
_PROGRESS_SQL = """
SELECT (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sent'),
       (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sending'),
       (SELECT count(*) FROM asyncwork_job WHERE published_at IS NOT NULL),
       (SELECT jsonb_object_agg(status, n) FROM
          (SELECT status, count(*) AS n FROM asyncwork_job GROUP BY status) AS s),
       (SELECT count(*) FROM asyncwork_deadletter),
       (SELECT array_agg(provider_invoice_id) FROM invoicing_invoice WHERE status = 'paid')
"""


def schedules_tune(db: Db) -> dict[str, Any]:
    """Shorten the beat intervals (``config.INTERVALS``) in the chaos database. Returns what
    the periodic tasks look like afterwards."""
    for name, every in config.INTERVALS.items():
        interval = db.value(
            "INSERT INTO django_celery_beat_intervalschedule (every, period) "
            "VALUES (%s, 'seconds') RETURNING id",
            [every],
        )
        updated = db.value(
            "UPDATE django_celery_beat_periodictask SET interval_id = %s, expire_seconds = %s "
            "WHERE name = %s RETURNING id",
            [interval, every, name],
        )
        if updated is None:
            raise RuntimeError(f"could not reschedule the periodic task {name!r}")
    rows = db.rows(
        "SELECT t.name, t.enabled, s.every FROM django_celery_beat_periodictask t "
        "LEFT JOIN django_celery_beat_intervalschedule s ON s.id = t.interval_id ORDER BY t.id"
    )
    return {
        name: {"enabled": enabled, "every_seconds": every} for name, enabled, every in rows or []
    }


@dataclass(frozen=True)
class Quiescence:
    reason: str  # complete | idle | timeout
    seconds: float


def quiesce(
    *,
    db: Db,
    smtp: SmtpServer,
    plan: Plan,
    acked: set[str],
    idle: float,
    settle: float,
    timeout: float,
) -> Quiescence:
    """Wait until every paid invoice has its email (or, for a refused recipient, a dead
    letter), no claim is in flight (a send a kill cut is delivered, but not done until a
    rescue has taken its claim over and marked it) and nothing has changed for ``settle``
    seconds; or until nothing at all has changed for ``idle`` seconds; or ``timeout``."""
    invoice_of = plan.invoice_of
    started = time.monotonic()
    last_change = started
    complete_since: float | None = None
    previous: tuple[Any, ...] = ()
    while True:
        now = time.monotonic()
        received = smtp.handler.received()
        delivered = {invoice_of.get(r.recipient) for r in received}
        accepted = len(received)
        row = db.rows(_PROGRESS_SQL)
        dead = db.rows(_DEAD_LETTER_INVOICES_SQL)
        if row is not None and dead is not None:
            sent, sending, published, statuses, letters, paid_ids = row[0]
            paid = set(paid_ids or []) | acked
            dead_lettered = {r[0] for r in dead}
            complete = (
                (paid - plan.refused) <= delivered
                and (paid & plan.refused) <= dead_lettered
                and sending == 0
            )
            jobs = tuple(sorted((statuses or {}).items()))
            progress = (accepted, sent, sending, published, jobs, letters, len(paid))
            if progress != previous:
                previous, last_change = progress, now
            complete_since = (complete_since or now) if complete else None
            if complete_since is not None and now - complete_since >= settle:
                return Quiescence("complete", round(now - started, 1))
        if now - last_change >= idle:
            return Quiescence("idle", round(now - started, 1))
        if now - started >= timeout:
            return Quiescence("timeout", round(now - started, 1))
        time.sleep(1)


def idle_window(arm: str) -> float:
    """How long nothing may change before the run is declared over without every email.

    Safe arm: past a running job's lease (the rescue by lease, the latest any safety net
    acts) plus a redelivery. Control arm: past a redelivery and two restore sweeps."""
    visibility = config.VISIBILITY_TIMEOUT
    if arm == config.SAFE:
        return config.JOB_LEASE_SECONDS + visibility + 10
    return visibility + 2 * config.RESTORE_INTERVAL


def run_arm(
    *,
    arm: str,
    profile: config.Profile,
    invoices: int,
    seed: int,
    log_dir: Path,
    broker: str = REDIS,
    without: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One arm; with ``profile.hosts``, across the hosts of ``chaos.hosts``: the topology is
    made first and removed last (also on an error or Ctrl-C), and this thread runs the arm
    from the control host (every thread and process it starts is born there). ``without``:
    the safety nets switched off (``chaos.ablation``: their patches applied to this checkout
    by the caller), named in the report."""
    with contextlib.ExitStack() as scope:
        net = None
        if profile.hosts:
            netns.stale_remove()
            net = scope.enter_context(hosts.topology(broker=broker))
            scope.enter_context(net.inside(hosts.CTL))
        return _run_arm(
            arm=arm,
            profile=profile,
            invoices=invoices,
            seed=seed,
            log_dir=log_dir,
            broker=broker,
            net=net,
            without=without,
        )


def _run_arm(
    *,
    arm: str,
    profile: config.Profile,
    invoices: int,
    seed: int,
    log_dir: Path,
    broker: str,
    net: Topology | None,
    without: tuple[str, ...],
) -> dict[str, Any]:
    log_dir.mkdir(parents=True, exist_ok=True)
    # On RabbitMQ the plan's broker restart is the node's (Redis, the cache, is not restarted).
    steps = tuple(
        replace(step, kind=RABBITMQ_RESTART)
        if broker == RABBITMQ and step.kind == REDIS_RESTART
        else step
        for step in profile.steps
    )
    rng = random.Random(seed)  # noqa: S311 - a reproducible plan, not secrets
    started = time.time()
    if net is None:
        smtp = SmtpServer(faults=config.smtp_faults(), seed=rng.getrandbits(32)).start()
        env = config.app_env(smtp_port=smtp.port)
    else:
        smtp = SmtpServer(
            faults=config.smtp_faults(), seed=rng.getrandbits(32), host=net.address(hosts.MAIL)
        )
        with net.inside(hosts.MAIL):  # its thread, and so its socket, are born there
            smtp.start()
        env = config.app_env(
            smtp_port=smtp.port,
            smtp_host=smtp.host,
            # The edge forwards the client's Host: its loopback address on the control host.
            web_hosts=(HOST, *(net.address(h) for h in hosts.WEB_HOSTS)),
        )
    extra: dict[str, Any] | None = None
    try:
        with (
            Stack(log_dir=log_dir, app_env=env, broker=broker, net=net) as stack,
            contextlib.ExitStack() as webs,
        ):
            assert stack.postgres is not None
            assert stack.redis is not None
            stack.postgres.create_database("chaos")
            stack.manage("migrate", "--noinput")
            stack.manage("setup_periodic_tasks")
            db = Db(stack.postgres.url("chaos"))
            schedules = schedules_tune(db)
            workers = WorkerPool(
                stack,
                count=profile.workers,
                concurrency=profile.concurrency,
                settings_module=config.worker_settings(arm),
                app=config.worker_app(arm),
                hosts=hosts.WORKER_HOSTS[: profile.workers] if net is not None else (),
            )
            if net is None:
                stack.start_beat()
                targets = [webs.enter_context(stack.web(workers=profile.web_workers))]
            else:
                for host in hosts.BEAT_HOSTS:
                    stack.start_beat(f"beat-{host}", host=host)
                edge_port = webs.enter_context(
                    hosts.behind_edge(stack, web_hosts=hosts.WEB_HOSTS, workers=profile.web_workers)
                )
                targets = [(HOST, edge_port)]
            plan = plan_build(
                invoices=invoices, rng=rng, refused_domain=smtp.handler.faults.refuse_domain
            )
            sender = Sender(
                targets=targets,
                secret=env["STRIPE_WEBHOOK_SECRET"],
                plan=plan,
                senders=profile.senders,
                rate=profile.rate,
                seed=rng.getrandbits(32),
            )
            observed: Broker | RabbitBroker = (
                RabbitBroker(stack.rabbit.address, stack.rabbit.port)
                if stack.rabbit is not None
                else Broker(stack.redis.port, host=stack.redis.address)
            )
            responses = sender.responses
            timeline = Timeline(
                Sources(
                    db=db,
                    broker=observed,
                    smtp_accepted=lambda: len(smtp.handler.received()),
                    events_acknowledged=lambda: len(responses.acked_events),
                )
            ).start()
            load_done = threading.Event()
            runner = FaultRunner(
                Context(
                    stack=stack,
                    workers=workers,
                    smtp=smtp,
                    db=db,
                    broker=observed,
                    sender=sender,
                    rng=rng,
                ),
                steps,
                load_done,
                gap=profile.fault_gap,
                isolate=profile.recovery_bound,
                injectors=hosts.INJECTORS if net is not None else None,
            ).start()
            sender.run()
            load_done.set()
            runner.join()
            quiescence = quiesce(
                db=db,
                smtp=smtp,
                plan=plan,
                acked=set(responses.acked_invoices),
                idle=idle_window(arm),
                settle=5,
                timeout=profile.quiesce_timeout,
            )
            timeline.stop()
            exits = stack.processes.unexpected_exits()
            facts = facts_collect(db, job_ids=report.job_ids_of(runner.records))
            if net is not None:
                extra = hosts.analysis(
                    net=net,
                    faults=runner.records,
                    log_dir=log_dir,
                    received=smtp.handler.received(),
                    started=started,
                    db=db,
                )
            db.close()
    finally:
        smtp.stop()
    return report.build(
        report.Inputs(
            arm=arm,
            profile=profile,
            seed=seed,
            started=started,
            ended=time.time(),
            plan=plan,
            sender=sender,
            smtp=smtp,
            faults=runner.records,
            facts=facts,
            timeline=timeline.samples,
            quiescence={"reason": quiescence.reason, "seconds": quiescence.seconds},
            schedules=schedules,
            unexpected_exits=exits,
            self_terminations=worker_self_terminations(log_dir),
            worker_outcomes=worker_outcomes(log_dir),
            failed_acks=worker_failed_acks(log_dir),
            log_dir=log_dir,
            broker=broker,
            hosts=extra,
            net_actions=net_actions(log_dir),
            without=without,
        )
    )
