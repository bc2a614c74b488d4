"""The same django.tasks work on every backend: ``.venv/bin/python -m bench.peers``.

Two task bodies (``bench.peer_tasks``: a no-op, and one email to the kit's SMTP server), each
enqueued one per transaction, through one arm at a time, the arms interleaved over rounds (the
order rotated each round; the median of the rounds is the figure):

==================  ===========================================================================
``asyncwork-redis``  ``@task`` / ``.enqueue()`` on ``asyncwork.backend.OutboxBackend`` (the job's
                     row in the caller's transaction, published on commit), Celery on Redis,
                     the project's worker (``celery -A core worker -P prefork -c 4``)
``asyncwork-rabbitmq``  the same on RabbitMQ, a virtual host of the run's own on the machine's
                     node (created and deleted by the run)
``django-tasks-db``  ``@task`` / ``.enqueue()`` on ``django_tasks_db.DatabaseBackend`` (its row in
                     the caller's transaction), two ``manage.py db_worker`` processes, as its
                     README gives them (https://github.com/RealOrangeOne/django-tasks-db)
``procrastinate``    procrastinate's Django integration, which has no django.tasks backend: its
                     own ``@app.task`` over the same bodies, ``.defer()`` inside the transaction
                     (its Django connector writes on Django's connection), two ``manage.py
                     procrastinate worker --concurrency 4`` processes (listen/notify on, its
                     default) (https://procrastinate.readthedocs.io/en/stable/howto/django.html);
                     ``procrastinate-unprepared``: the same on Django's own database options
                     (no prepared statements), which cost procrastinate more than they save it
``fennel``           ``@task`` / ``.enqueue()`` on ``django_tasks_fennel.CeleryBackend``
                     (django.tasks on Celery), enqueued in ``transaction.on_commit`` as Django's
                     docs advise for a backend without transactions; the result backend on Redis
                     with ``result_extended``, as its checks ask
                     (https://github.com/matiasb/django-tasks-fennel); the project's worker
``tutorial``         Celery's ``@shared_task`` over the same bodies, ``delay_on_commit``
                     (bench/tutorial.py's way); the project's worker
==================  ===========================================================================

Every arm runs on the project's settings (``bench.peers_settings``), its database options
included: prepared statements (``core/settings.py``). ``fennel`` and ``tutorial`` are the
non-transactional peers: a process that dies between the commit and the publish loses the task.
Each arm's Celery keys are under a prefix of its own.

Per arm and round: (1) **enqueues/s** inside transactions, one task per transaction, from two
client threads, with the workers stopped; (2) **drained/s** of those no-op tasks: the workers
started, the time from the first task's start to the last one's end, per core too; (3) the same
burn-down of email tasks, **emails/s**; (4) **enqueue-to-start latency**, p50 and p99, with the
enqueues paced open loop at half the arm's no-op drain rate of that round; (5) a **kill -9** of
a worker (a Celery worker's whole process group; one of the two ``db_worker`` or procrastinate
processes) halfway through a paced load of tasks that each take 200 ms, offered to keep 80% of the
arm's slots busy (at most half its drain rate), a new worker started at once as a supervisor would,
then: tasks not run once the arm's own bound on giving a dead worker's tasks back has passed
(asyncwork on Redis: 700 s, its republish of a job whose message a dead consumer took from Redis
without recording it, 600 s, plus the sweep's minute; 30 s for every other arm), tasks run twice,
and the longest a task that ran waited to start. Each task records its runs in ``bench_peer_run``
(keyed by arm and task number), from which every figure is read. For each burn-down: CPU ms per
task of the workers, PostgreSQL, Redis and RabbitMQ (the machine's node: shared with its other
users), and PostgreSQL transactions and rows written per task (``pg_stat_database``, read once the
workers have exited; worker start-up included).

Goals (``bench.report``): asyncwork ≥ 1.2 x the best transactional peer (django-tasks-db,
procrastinate either way) on drained/s and emails/s, ≥ 1.0 x on enqueues/s, its p99 the lowest
of the transactional arms, lost 0. The run owns a database (``invoicing_bench_peers``, dropped at
the end), Redis keys under its prefix, and its RabbitMQ virtual host; every process it starts is
stopped on the way out. Results: ``bench/results/peers.json``.

    .venv/bin/python -m bench.peers [--quick] [--tasks 20000 --emails 2000 --rounds 2 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from asyncwork.poll import UNSTARTED_EVERY_SECONDS
from asyncwork.settings import SETTINGS
from bench.harness import percentile
from bench.report import Goal, machine, results_write, table
from bench.run import (
    REDIS_URL,
    RESULTS,
    DatabaseBusy,
    RunConfig,
    cpu_metered,
    cpu_per_item,
    database_exclusive,
    database_recreate,
    pids_named,
    redis_prefix_delete,
    sigterm_as_interrupt,
    stack_env,
    stack_pids,
)
from stack import launch
from stack.process import ROOT, Process, stop_all
from stack.smtp import SmtpServer

DATABASE_URL = "postgres://postgres@127.0.0.1:5432/invoicing_bench_peers"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672"
TABLE = "bench_peer_run"
CLIENT_THREADS = 2  # workload (1): enqueues from two client threads
PACED_THREADS = 4  # the open-loop senders of (4) and (5), so an enqueue is rarely late
KILL_HOLD = 0.2  # seconds each task of (5) takes, so a kill lands mid-task
KILL_BUSY = 0.8  # (5) offers the tasks that keep this share of the arm's slots busy
CELERY_CONCURRENCY = 4  # the project's worker: 1 x prefork 4
PROCESSES = 2  # db_worker and procrastinate workers
PROCRASTINATE_CONCURRENCY = 4
TRANSACTIONAL = ("django-tasks-db", "procrastinate", "procrastinate-unprepared")
WARMUP = 40  # tasks run before a paced load, so no worker is still starting


@dataclass(frozen=True)
class Arm:
    name: str
    backend: str  # bench.peers_settings' PEER_BACKENDS key
    worker: str  # "celery", "db_worker" or "procrastinate"
    enqueue: str  # "django", "django-relay", "django-on-commit", "procrastinate" or "celery"
    broker: str = "redis"
    transactional: bool = True
    settings: Mapping[str, Any] = field(default_factory=dict)
    # Seconds after the kill before a task not run counts as lost: the arm's own bound on giving
    # a dead worker's tasks back, or SETTLE where it has none.
    settle: float = 0.0
    concurrency: int = CELERY_CONCURRENCY  # a Celery worker's pool processes (or threads)
    pool: str = "prefork"  # a Celery worker's pool
    celery_workers: int = 1


# The wait after a kill for an arm with no recovery of its own (a late run still counts).
SETTLE = 30.0
# asyncwork on Redis: a dead worker's claimed jobs come back by heartbeat within seconds, and
# the messages it had reserved but not started wait in Redis's unacknowledged set for the
# transport's visibility timeout (180 s, core/settings.py); a message it had taken from Redis and
# not yet recorded there is gone, and its job is published again once it has been
# REPUBLISH_UNSTARTED_SECONDS unstarted, by the next sweep (asyncwork.poll: every 60 s). So the
# wait is that bound and a margin.
REDIS_RESTORE_BOUND = SETTINGS["REPUBLISH_UNSTARTED_SECONDS"].default + UNSTARTED_EVERY_SECONDS + 40


# Django's own database options, which the project's settings change: no server-side binding,
# no prepared statements (core/settings.py).
DJANGO_DATABASE_DEFAULTS = {"OPTIONS": {"server_side_binding": False, "prepare_threshold": None}}

ARMS = (
    Arm("asyncwork-redis", "asyncwork", "celery", "django", settle=REDIS_RESTORE_BOUND),
    Arm("asyncwork-rabbitmq", "asyncwork", "celery", "django", broker="rabbitmq"),
    Arm("django-tasks-db", "db", "db_worker", "django"),
    Arm("procrastinate", "none", "procrastinate", "procrastinate"),
    # The same on Django's database defaults: prepared statements cost procrastinate PostgreSQL
    # CPU (2.36 against 1.59 ms per task, in two runs), so it is measured both ways and the goals
    # are judged against the better.
    Arm(
        "procrastinate-unprepared",
        "none",
        "procrastinate",
        "procrastinate",
        settings={"DATABASE": DJANGO_DATABASE_DEFAULTS},
    ),
    Arm(
        "fennel",
        "fennel",
        "celery",
        "django-on-commit",
        transactional=False,
        settings={"CELERY_RESULT_BACKEND": "redis", "CELERY_RESULT_EXTENDED": True},
    ),
    Arm("tutorial", "none", "celery", "celery", transactional=False),
)
ARM_NAMES = tuple(arm.name for arm in ARMS)


# The plain levers (``--levers``), each asyncwork on Redis with one change, measured in one run
# against the arm as configured (``asyncwork-redis``): settings as Django and Celery document them.
def _lever(name: str, *, enqueue: str = "django", **change: Any) -> Arm:
    return Arm(name, "asyncwork", "celery", enqueue, settle=REDIS_RESTORE_BOUND, **change)


LEVERS = (
    # Taken (core/settings.py), so measured the other way: Django's database defaults, no
    # server-side binding and no prepared statements (Django turns psycopg's threshold off unless
    # OPTIONS gives it): https://docs.djangoproject.com/en/5.2/ref/databases/#server-side-parameters-binding
    _lever("lever-unprepared", settings={"DATABASE": DJANGO_DATABASE_DEFAULTS}),
    # Django's connection pool (psycopg_pool) in place of persistent connections:
    # https://docs.djangoproject.com/en/5.2/ref/databases/#connection-pool
    _lever(
        "lever-pool",
        settings={"DATABASE": {"CONN_MAX_AGE": 0, "OPTIONS": {"pool": True}}},
    ),
    # No health check (a SELECT 1) before the first query of each task.
    _lever("lever-no-health-checks", settings={"DATABASE": {"CONN_HEALTH_CHECKS": False}}),
    # Four messages reserved per pool process instead of one.
    _lever("lever-prefetch-4", settings={"CELERY_WORKER_PREFETCH_MULTIPLIER": 4}),
    # Eight pool processes instead of four: more runs waiting on I/O at once.
    _lever("lever-concurrency-8", concurrency=8),
    # Celery's threads pool: two workers of two threads each (the same four slots, one process
    # per core), each running its tasks in the process that takes their messages, with no pipe
    # to a pool process between them.
    _lever("lever-threads", pool="threads", concurrency=2, celery_workers=2),
    # Batched relay publishes: nothing published at commit (the client drops the enqueue's
    # on-commit publish); each worker's poll (asyncwork.poll, every POLL_SECONDS) publishes the
    # committed rows, RELAY_BATCH_SIZE to a transaction, marked with one UPDATE per batch.
    _lever(
        "lever-relay-publishes",
        enqueue="django-relay",
        settings={"ASYNCWORK": {"OUTBOX_RELAY_GRACE_SECONDS": 0}},
    ),
)
LEVER_NAMES = ("asyncwork-redis", *(arm.name for arm in LEVERS))


# --- The client: one subprocess per batch, with the arm's settings ------------------------------


def _enqueuer(arm: Arm, kind: str, hold: float) -> Callable[[int], None]:
    """Enqueue task ``n`` of ``kind`` the arm's way, inside the caller's transaction."""
    from functools import partial

    from django.db import transaction

    from bench import peer_tasks

    args: tuple[Any, ...] = (hold,) if kind == "noop" else ()
    if arm.enqueue == "django":
        task = getattr(peer_tasks, kind)
        return lambda n: task.enqueue(n, *args)
    if arm.enqueue == "django-relay":
        task = getattr(peer_tasks, kind)

        def enqueue_unpublished(n: int) -> None:
            task.enqueue(n, *args)
            # The enqueue registered one hook, its publish at commit: left to the relay instead.
            transaction.get_connection().run_on_commit.pop()

        return enqueue_unpublished
    if arm.enqueue == "django-on-commit":
        task = getattr(peer_tasks, kind)
        return lambda n: transaction.on_commit(partial(task.enqueue, n, *args))
    if arm.enqueue == "procrastinate":
        deferred = getattr(peer_tasks, f"procrastinate_{kind}")
        names = ("n", "hold")[: 1 + len(args)]
        return lambda n: deferred.defer(**dict(zip(names, (n, *args), strict=True)))
    celery_task = getattr(peer_tasks, f"celery_{kind}")
    return lambda n: celery_task.delay_on_commit(n, *args)


def client_main(args: argparse.Namespace) -> int:
    """Enqueue tasks ``first`` .. ``first + count - 1``, each in a transaction of its own, from
    ``threads`` threads: back to back, or task ``i`` due ``i / rate`` s after the start (open
    loop). Prints one line, ``RESULT <json>``: the elapsed time and, per task, when it was due
    and when its transaction committed (``time.time()``)."""
    import django

    django.setup()
    from django.db import connection, transaction

    arm = next(a for a in (*ARMS, *LEVERS) if a.name == args.arm)
    enqueue = _enqueuer(arm, args.kind, args.hold)
    numbers = itertools.count()
    committed: list[float] = [math.nan] * args.count
    due: list[float] = [math.nan] * args.count
    errors: list[str] = []
    start = time.time() + 0.05

    def send() -> None:
        try:
            while (i := next(numbers)) < args.count:
                if args.rate:
                    due[i] = start + i / args.rate
                    if (wait := due[i] - time.time()) > 0:
                        time.sleep(wait)
                with transaction.atomic():
                    enqueue(args.first + i)
                committed[i] = time.time()
        except Exception as exc:  # reported on the result line, not lost with the thread
            errors.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(args.threads)]
    began, cpu = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    outcome = {"elapsed": elapsed, "cpu": cpu, "committed": committed, "due": due}
    print("RESULT " + json.dumps({**outcome, "errors": errors}))
    return 1 if errors else 0


# --- The driver ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Options:
    tasks: int
    emails: int
    rounds: int
    latency_seconds: float
    kill_seconds: float
    arms: tuple[Arm, ...]
    database_url: str
    redis_url: str
    output: Path
    quick: bool


class ArmStack:
    """One arm's environment and workers; its task numbers (every task of a run has its own)."""

    def __init__(self, arm: Arm, env: Mapping[str, str], log: str) -> None:
        self.arm = arm
        self.env = dict(env)
        self.log = log
        self.workers: list[Process] = []
        self.started = 0
        self.next_n = 0

    def numbers(self, count: int) -> tuple[int, int]:
        first, self.next_n = self.next_n, self.next_n + count
        return first, count

    def _worker(self) -> Process:
        self.started += 1
        log = RESULTS / f"{self.log}.workers.log"  # every worker of the arm, appended
        name = f"peers-{self.arm.name}-{self.started}"
        if self.arm.worker == "celery":
            return launch.celery_worker(
                self.env,
                name=name,
                pool=self.arm.pool,
                concurrency=self.arm.concurrency,
                include=("bench.peer_tasks",),
                loglevel="WARNING",
                log=log,
                append=True,
                ready=lambda _: True,
            )
        if self.arm.worker == "db_worker":
            argv = ["db_worker", "--backend", "peer", "--queue-name", "default"]
        else:
            argv = ["procrastinate", "worker", "--concurrency", str(PROCRASTINATE_CONCURRENCY)]
        return Process(
            [sys.executable, "manage.py", *argv], name=name, env=self.env, log=log, append=True
        )

    def slots(self) -> int:
        """Tasks the arm's workers run at once."""
        if self.arm.worker == "celery":
            return self.arm.celery_workers * self.arm.concurrency
        if self.arm.worker == "procrastinate":
            return PROCESSES * PROCRASTINATE_CONCURRENCY
        return PROCESSES

    def start(self) -> None:
        count = self.arm.celery_workers if self.arm.worker == "celery" else PROCESSES
        self.workers = [self._worker() for _ in range(count)]

    def kill_one(self) -> None:
        """SIGKILL of one worker's whole process group, and a new worker in its place."""
        victim = self.workers.pop(0)
        victim.kill()
        self.workers.append(self._worker())

    def stop(self) -> None:
        stop_all(self.workers, grace=20)
        self.workers = []

    def pids(self) -> list[int]:
        return [pid for worker in self.workers for pid in worker.pids()]

    def client(
        self, kind: str, count: int, *, threads: int, rate: float = 0.0, hold: float = 0.0
    ) -> tuple[int, dict[str, Any]]:
        first, _ = self.numbers(count)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.peers",
                "client",
                "--arm",
                self.arm.name,
                "--kind",
                kind,
                "--first",
                str(first),
                "--count",
                str(count),
                "--threads",
                str(threads),
                "--rate",
                str(rate),
                "--hold",
                str(hold),
            ],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{self.arm.name} client failed: {done.stderr[-2000:]}")
        result = json.loads(line.removeprefix("RESULT "))
        if result["errors"]:
            raise RuntimeError(f"{self.arm.name} client: {result['errors'][:3]}")
        return first, result


def _db(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def runs_of(url: str, arm: str, first: int, count: int) -> list[tuple[int, int, float, float]]:
    with _db(url) as db:
        return db.execute(
            f"SELECT n, runs, started, finished FROM {TABLE} WHERE arm = %s AND n >= %s "
            "AND n < %s ORDER BY n",
            [arm, first, first + count],
        ).fetchall()


def wait_done(url: str, arm: str, first: int, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    with _db(url) as db:
        while time.monotonic() < deadline:
            row = db.execute(
                f"SELECT count(*) FROM {TABLE} WHERE arm = %s AND n >= %s AND n < %s",
                [arm, first, first + count],
            ).fetchone()
            if row is not None and row[0] >= count:
                return True
            time.sleep(0.05)
    return False


def db_activity(url: str) -> tuple[int, int]:
    """Transactions committed and rows written so far in the run's database."""
    name = urlsplit(url).path.lstrip("/")
    with _db(url) as db:
        row = db.execute(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted "
            "FROM pg_stat_database WHERE datname = %s",
            [name],
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def burn_down(stack: ArmStack, kind: str, count: int, options: Options) -> dict[str, Any]:
    """(1) enqueue ``count`` tasks with the workers stopped; (2)/(3) start the workers and time
    the drain; the CPU and the database's work per task."""
    database = urlsplit(options.database_url).path.lstrip("/")

    def groups() -> dict[str, list[int]]:
        found = stack_pids(gunicorn=[], database=database)
        return {
            "workers": stack.pids(),
            "postgres": found["postgres"],
            "redis": found["redis"],
            "rabbitmq": pids_named("beam.smp"),
        }

    start = db_activity(options.database_url)
    with cpu_metered(groups, every=0.5) as enqueue_cpu:
        first, enqueued = stack.client(kind, count, threads=CLIENT_THREADS)
    before = db_activity(options.database_url)
    enqueue_cpu_ms = {
        **{
            k: v
            for k, v in cpu_per_item(enqueue_cpu, count).items()
            if k not in ("other", "workers")
        },
        "client": enqueued["cpu"] * 1000 / count,
    }
    with cpu_metered(groups, every=0.5) as cpu:
        stack.start()
        done = wait_done(options.database_url, stack.arm.name, first, count, 120 + count / 20)
    stack.stop()
    after = db_activity(options.database_url)
    rows = runs_of(options.database_url, stack.arm.name, first, count)
    seconds = max(r[3] for r in rows) - min(r[2] for r in rows) if rows else math.nan
    rate = len(rows) / seconds if done and seconds > 0 else math.nan
    return {
        "tasks": count,
        "completed": len(rows),
        "done": done,
        "enqueue_rate": count / enqueued["elapsed"],
        "enqueue_cpu_ms_per_task": enqueue_cpu_ms,
        "enqueue_transactions_per_task": (before[0] - start[0]) / count,
        "drain_seconds": seconds,
        "drain_rate": rate,
        "drain_rate_per_core": rate / (os.cpu_count() or 1),
        "cpu_ms_per_task": {
            k: v for k, v in cpu_per_item(cpu, len(rows) or 1).items() if k != "other"
        },
        "transactions_per_task": (after[0] - before[0]) / (len(rows) or 1),
        "rows_written_per_task": (after[1] - before[1]) / (len(rows) or 1),
    }


def warm(stack: ArmStack, options: Options) -> None:
    """Before a paced load: every worker started and taking tasks (a few run), then a pause."""
    first, _ = stack.client("noop", WARMUP, threads=CLIENT_THREADS)
    if not wait_done(options.database_url, stack.arm.name, first, WARMUP, 120):
        raise RuntimeError(f"{stack.arm.name}: the workers ran none of {WARMUP} tasks")
    time.sleep(1.0)


def latency(stack: ArmStack, rate: float, options: Options) -> dict[str, Any]:
    """(4): enqueues paced at ``rate`` for ``latency_seconds``; enqueue-to-start p50/p99."""
    count = max(10, int(rate * options.latency_seconds))
    first, sent = stack.client("noop", count, threads=PACED_THREADS, rate=rate)
    done = wait_done(options.database_url, stack.arm.name, first, count, 60 + count / 20)
    rows = runs_of(options.database_url, stack.arm.name, first, count)
    delays = sorted(started - sent["committed"][n - first] for n, _, started, _ in rows)
    lags = sorted(c - d for c, d in zip(sent["committed"], sent["due"], strict=True))
    return {
        "rate": rate,
        "tasks": count,
        "completed": len(rows),
        "done": done,
        "p50_ms": percentile(delays, 50) * 1000,
        "p99_ms": percentile(delays, 99) * 1000,
        "enqueue_lag_p99_ms": percentile(lags, 99) * 1000,
    }


def kill(stack: ArmStack, rate: float, options: Options) -> dict[str, Any]:
    """(5): a paced load of tasks taking ``KILL_HOLD`` s each; a worker killed halfway."""
    count = max(10, int(rate * options.kill_seconds))
    # Halfway: once the first half of the tasks has run (the client takes a second or two to
    # start, so a timer would fire before the load), while the rest are arriving.
    first = stack.next_n  # the client's tasks are the next numbers

    def kill_halfway() -> None:
        wait_done(options.database_url, stack.arm.name, first, count // 2, 120)
        stack.kill_one()

    halfway = threading.Thread(target=kill_halfway)
    halfway.start()
    try:
        _, sent = stack.client("noop", count, threads=PACED_THREADS, rate=rate, hold=KILL_HOLD)
    finally:
        halfway.join()
    settle = stack.arm.settle or SETTLE
    wait_done(options.database_url, stack.arm.name, first, count, settle)
    time.sleep(1.0)  # a second run of a task already counted
    rows = runs_of(options.database_url, stack.arm.name, first, count)
    return {
        "rate": rate,
        "tasks": count,
        "lost": count - len(rows),
        "twice": sum(1 for _, runs, _, _ in rows if runs > 1),
        # The longest a task that ran waited to start: a task the kill held, given back late.
        "slowest_start_s": max(
            (started - sent["committed"][n - first] for n, _, started, _ in rows), default=0.0
        ),
        "settle_seconds": settle,
    }


def one_round(stack: ArmStack, options: Options) -> dict[str, Any]:
    noop = burn_down(stack, "noop", options.tasks, options)
    emails = burn_down(stack, "email", options.emails, options)
    rate = noop["drain_rate"] / 2 if not math.isnan(noop["drain_rate"]) else 10.0
    stack.start()
    try:
        warm(stack, options)
        paced = latency(stack, rate, options)
        killed = kill(stack, min(rate, KILL_BUSY * stack.slots() / KILL_HOLD), options)
    finally:
        stack.stop()
    return {"noop": noop, "email": emails, "latency": paced, "kill": killed}


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "enqueue_rate": _median([r["noop"]["enqueue_rate"] for r in rounds]),
        "drain_rate": _median([r["noop"]["drain_rate"] for r in rounds]),
        "drain_rate_per_core": _median([r["noop"]["drain_rate_per_core"] for r in rounds]),
        "email_rate": _median([r["email"]["drain_rate"] for r in rounds]),
        "p50_ms": _median([r["latency"]["p50_ms"] for r in rounds]),
        "p99_ms": _median([r["latency"]["p99_ms"] for r in rounds]),
        "lost": sum(r["kill"]["lost"] for r in rounds),
        "twice": sum(r["kill"]["twice"] for r in rounds),
        "slowest_start_s": max(r["kill"]["slowest_start_s"] for r in rounds),
        "completed": all(
            r["noop"]["done"] and r["email"]["done"] and r["latency"]["done"] for r in rounds
        ),
        "cpu_ms_per_task": {
            group: _median([r["noop"]["cpu_ms_per_task"][group] for r in rounds])
            for group in rounds[0]["noop"]["cpu_ms_per_task"]
        },
        "cpu_ms_per_email": {
            group: _median([r["email"]["cpu_ms_per_task"][group] for r in rounds])
            for group in rounds[0]["email"]["cpu_ms_per_task"]
        },
        "transactions_per_task": _median([r["noop"]["transactions_per_task"] for r in rounds]),
        "enqueue_cpu_ms_per_task": {
            group: _median([r["noop"]["enqueue_cpu_ms_per_task"][group] for r in rounds])
            for group in rounds[0]["noop"]["enqueue_cpu_ms_per_task"]
        },
        "enqueue_transactions_per_task": _median(
            [r["noop"]["enqueue_transactions_per_task"] for r in rounds]
        ),
        "rows_written_per_task": _median([r["noop"]["rows_written_per_task"] for r in rounds]),
        "transactions_per_email": _median([r["email"]["transactions_per_task"] for r in rounds]),
    }


def goals(arms: Mapping[str, dict[str, Any]]) -> list[Goal]:
    """asyncwork (on each broker) against the best transactional peer."""
    peers = {name: arms[name] for name in TRANSACTIONAL if name in arms}
    found: list[Goal] = []
    for name in ("asyncwork-redis", "asyncwork-rabbitmq"):
        if name not in arms or not peers:
            continue
        ours = arms[name]
        for metric, key, limit, unit in (
            ("no-op tasks drained/s", "drain_rate", 1.2, "/s"),
            ("emails drained/s", "email_rate", 1.2, "/s"),
            ("enqueues/s in transactions", "enqueue_rate", 1.0, "/s"),
        ):
            best = max(peers, key=lambda p: _nan_low(peers[p][key]))
            theirs = peers[best][key]
            found.append(
                Goal(
                    source="peers",
                    metric=f"{name} {metric} ÷ best transactional peer",
                    value=f"{ours[key]:.0f} / {theirs:.0f} {unit} ({best})",
                    measured=ours[key] / theirs if theirs else math.nan,
                    op=">=",
                    limit=limit,
                )
            )
        lowest = min(peers, key=lambda p: _nan_high(peers[p]["p99_ms"]))
        found.append(
            Goal(
                source="peers",
                metric=f"{name} p99 enqueue-to-start ÷ lowest transactional peer's",
                value=f"{ours['p99_ms']:.0f} / {peers[lowest]['p99_ms']:.0f} ms ({lowest})",
                measured=ours["p99_ms"] / peers[lowest]["p99_ms"],
                op="<=",
                limit=1.0,
            )
        )
        found.append(
            Goal(
                source="peers",
                metric=f"{name} tasks lost to a worker's kill -9",
                value=f"{ours['lost']} lost, {ours['twice']} run twice",
                measured=float(ours["lost"]),
                op="<=",
                limit=0.0,
                unit="tasks",
            )
        )
    return found


def _nan_low(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def _nan_high(value: float) -> float:
    return math.inf if math.isnan(value) else value


def versions() -> dict[str, str]:
    names = (
        "Django",
        "django-tasks",
        "celery",
        "kombu",
        "django-tasks-db",
        "procrastinate",
        "django-tasks-fennel",
        "psycopg",
    )
    return {name: metadata.version(name) for name in names}


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def owned(options: Options) -> Iterator[tuple[str, str]]:
    """The run's database (recreated, migrated with every peer's tables, dropped at the end),
    a Redis prefix and a RabbitMQ virtual host of its own (deleted at the end)."""
    sigterm_as_interrupt()
    run_id = f"bench-{secrets.token_hex(6)}"
    vhost = f"{run_id}-peers"
    with database_exclusive(url=options.database_url), contextlib.ExitStack() as stack:
        print(f"recreating {options.database_url} ...", flush=True)
        database_recreate(url=options.database_url)
        stack.callback(_database_drop, options.database_url)
        env = _env(options, ARMS[0], f"{run_id}:", vhost="")
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "--verbosity=0"],
            cwd=ROOT,
            env=env,
            check=True,
        )
        with _db(options.database_url) as db:
            db.execute(
                f"CREATE TABLE {TABLE} (arm text, n integer, runs integer NOT NULL, "
                "started double precision NOT NULL, finished double precision NOT NULL, "
                "PRIMARY KEY (arm, n))"
            )
        if any(arm.broker == "rabbitmq" for arm in options.arms):
            rabbitmqctl("add_vhost", vhost)
            stack.callback(rabbitmqctl, "delete_vhost", vhost)
            rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        stack.callback(
            lambda: print(
                f"deleted {redis_prefix_delete(url=options.redis_url, prefix=run_id)} "
                f"Redis key(s) under {run_id}",
                flush=True,
            )
        )
        yield run_id, vhost


def _database_drop(url: str) -> None:
    name = urlsplit(url).path.lstrip("/")
    subprocess.run(
        ["dropdb", "--host=127.0.0.1", "--username=postgres", "--if-exists", "--force", name],
        check=True,
    )
    print(f"dropped database {name}", flush=True)


def _env(
    options: Options, arm: Arm, prefix: str, *, vhost: str, smtp_port: int | None = None
) -> dict[str, str]:
    broker = f"{RABBITMQ_URL}/{vhost}" if arm.broker == "rabbitmq" else ""
    run = RunConfig(
        name=f"peers-{arm.name}",
        prefix=prefix,
        database_url=options.database_url,
        redis_url=options.redis_url,
        broker_url=broker,
    )
    settings = dict(arm.settings)
    if settings.get("CELERY_RESULT_BACKEND") == "redis":
        settings["CELERY_RESULT_BACKEND"] = options.redis_url
        settings["CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS"] = {"global_keyprefix": prefix}
    return {
        **stack_env(run, settings={}, smtp_port=smtp_port),
        "DJANGO_SETTINGS_MODULE": "bench.peers_settings",
        "BENCH_SETTINGS": json.dumps(settings),
        "PEERS_ARM": arm.name,
        "PEERS_BACKEND": arm.backend,
    }


def measure(options: Options) -> dict[str, Any]:
    per_arm: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in options.arms}
    with owned(options) as (run_id, vhost), SmtpServer() as sink:
        stacks = {
            arm.name: ArmStack(
                arm,
                _env(options, arm, f"{run_id}:{arm.name}:", vhost=vhost, smtp_port=sink.port),
                log=f"peers-{arm.name}",
            )
            for arm in options.arms
        }
        try:
            for round_ in range(options.rounds):
                shift = round_ % len(options.arms)
                order = [*options.arms[shift:], *options.arms[:shift]]
                for arm in order:
                    result = one_round(stacks[arm.name], options)
                    per_arm[arm.name].append(result)
                    print(
                        f"  round {round_ + 1} {arm.name:<19} "
                        f"enqueue {result['noop']['enqueue_rate']:7.0f}/s  "
                        f"drain {result['noop']['drain_rate']:7.0f}/s  "
                        f"emails {result['email']['drain_rate']:6.0f}/s  "
                        f"p50/p99 {result['latency']['p50_ms']:6.0f}/"
                        f"{result['latency']['p99_ms']:6.0f} ms  "
                        f"lost {result['kill']['lost']} twice {result['kill']['twice']} "
                        f"slowest {result['kill']['slowest_start_s']:.1f} s",
                        flush=True,
                    )
        finally:
            for stack in stacks.values():
                stack.stop()
        emails_received = len(sink.messages)
    arms = {name: summarize(rounds) for name, rounds in per_arm.items()}
    return {
        "versions": versions(),
        "arms": arms,
        "rounds": per_arm,
        "emails_received": emails_received,
        "summary": [goal.as_dict() for goal in goals(arms)],
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        f"{'arm':<19} {'enqueue/s':>9} {'drain/s':>8} {'per core':>8} {'emails/s':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'lost':>5} {'twice':>5}"
    ]
    for name, s in results["arms"].items():
        lines.append(
            f"{name:<19} {s['enqueue_rate']:>9.0f} {s['drain_rate']:>8.0f} "
            f"{s['drain_rate_per_core']:>8.0f} {s['email_rate']:>8.1f} {s['p50_ms']:>7.0f} "
            f"{s['p99_ms']:>7.0f} {s['lost']:>5} {s['twice']:>5}"
        )
    lines += [
        "",
        f"{'CPU ms per':<19} {'task: workers':>13} {'pg':>6} {'redis':>6} {'rabbit':>6} "
        f"{'xact':>5}   {'enqueue: client':>15} {'pg':>6} {'redis':>6} {'rabbit':>6} {'xact':>5}",
    ]
    for name, s in results["arms"].items():
        cpu, enq = s["cpu_ms_per_task"], s["enqueue_cpu_ms_per_task"]
        lines.append(
            f"{name:<19} {cpu['workers']:>13.2f} {cpu['postgres']:>6.2f} {cpu['redis']:>6.2f} "
            f"{cpu['rabbitmq']:>6.2f} {s['transactions_per_task']:>5.1f}   "
            f"{enq['client']:>15.2f} {enq['postgres']:>6.2f} {enq['redis']:>6.2f} "
            f"{enq['rabbitmq']:>6.2f} {s['enqueue_transactions_per_task']:>5.1f}"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Options | argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="internal: one arm's enqueues, in its environment")
    client.add_argument("--arm", choices=(*ARM_NAMES, *LEVER_NAMES), required=True)
    client.add_argument("--kind", choices=("noop", "email"), required=True)
    client.add_argument("--first", type=int, required=True)
    client.add_argument("--count", type=int, required=True)
    client.add_argument("--threads", type=int, default=CLIENT_THREADS)
    client.add_argument("--rate", type=float, default=0.0)
    client.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--quick", action="store_true", help="2,000 tasks, 300 emails, 1 round")
    parser.add_argument("--tasks", type=int, help="no-op tasks per burn-down (20,000)")
    parser.add_argument("--emails", type=int, help="email tasks per burn-down (2,000)")
    parser.add_argument("--rounds", type=int, help="rounds (2)")
    parser.add_argument("--latency-seconds", type=float, help="paced load of (4), seconds (15)")
    parser.add_argument("--kill-seconds", type=float, help="paced load of (5), seconds (10)")
    parser.add_argument("--arms", default=",".join(ARM_NAMES), help="comma-separated arms")
    parser.add_argument(
        "--levers",
        action="store_true",
        help="asyncwork on Redis as configured and with each plain lever "
        "(results: peers_levers.json)",
    )
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--output", type=Path, default=RESULTS / "peers.json")
    args = parser.parse_args(argv)
    if args.command == "client":
        return args
    chosen = [name.strip() for name in args.arms.split(",") if name.strip()]
    if args.levers:
        chosen = list(LEVER_NAMES)
        if args.output == RESULTS / "peers.json":
            args.output = RESULTS / "peers_levers.json"
    unknown = set(chosen) - {*ARM_NAMES, *LEVER_NAMES}
    if unknown or not chosen:
        parser.error(f"unknown arm(s): {', '.join(sorted(unknown)) or '(none)'}")
    if urlsplit(args.database_url).path.lstrip("/") in ("", "invoicing"):
        parser.error("give the benchmark a database of its own (--database-url)")
    quick = {"tasks": 2000, "emails": 300, "rounds": 1, "latency_seconds": 5.0, "kill_seconds": 6.0}
    full = {
        "tasks": 20000,
        "emails": 2000,
        "rounds": 2,
        "latency_seconds": 15.0,
        "kill_seconds": 10.0,
    }
    profile = quick if args.quick else full
    sizes: dict[str, Any] = {
        k: v if (v := getattr(args, k)) is not None else profile[k] for k in profile
    }
    if min(sizes["tasks"], sizes["emails"], sizes["rounds"]) < 1:
        parser.error("--tasks, --emails and --rounds must be at least 1")
    return Options(
        **sizes,
        arms=tuple(arm for arm in (*ARMS, *LEVERS) if arm.name in chosen),
        database_url=args.database_url,
        redis_url=args.redis_url,
        output=args.output,
        quick=args.quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    if isinstance(options, argparse.Namespace):
        return client_main(options)
    started = time.time()
    host = machine(postgres_url=options.database_url, redis_url=options.redis_url)
    try:
        results = measure(options)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except DatabaseBusy as exc:
        print(f"not run: {exc}", file=sys.stderr)
        return 1
    complete = all(arm["completed"] for arm in results["arms"].values())
    results["checks"] = {
        "ok": complete,
        "expected": "every arm's tasks completed",
        "found": {name: arm["completed"] for name, arm in results["arms"].items()},
    }
    results_write(
        options.output,
        benchmark="peers",
        started=started,
        results=results,
        config={
            "profile": "quick" if options.quick else "full",
            "tasks": options.tasks,
            "emails": options.emails,
            "rounds": options.rounds,
            "latency_seconds": options.latency_seconds,
            "kill_seconds": options.kill_seconds,
            "kill_hold_seconds": KILL_HOLD,
            "kill_busy_share": KILL_BUSY,
            "settle_seconds": {arm.name: arm.settle or SETTLE for arm in options.arms},
            "client_threads": CLIENT_THREADS,
            "celery_worker": f"1 x celery worker -P prefork -c {CELERY_CONCURRENCY}",
            "db_worker": f"{PROCESSES} x manage.py db_worker",
            "procrastinate": (
                f"{PROCESSES} x manage.py procrastinate worker "
                f"--concurrency {PROCRASTINATE_CONCURRENCY}"
            ),
            "arms": [arm.name for arm in options.arms],
        },
        host=host,
    )
    print()
    print(report(results))
    print()
    print(table(Goal.from_dict(goal) for goal in results["summary"]))
    print(f"\nresults: {options.output}")
    if not complete:
        print("FAILED: an arm did not complete its tasks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
