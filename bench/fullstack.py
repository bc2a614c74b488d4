"""The whole stack for the end-to-end benchmarks, around one run (``bench.run``): the SMTP
server and Celery worker processes (``backend``), gunicorn in front (``serving``), and the
checks of what the pipeline stored and emailed.

* The SMTP server is the kit's (``stack.smtp``), in this process; it accepts everything, after
  a delay when asked (``Backend.sink.handler.faults.delay``, changeable while it runs), which
  each session awaits on its own: a slow provider answers many sessions slowly, it does not
  serialise them. Each message's Message-ID names its invoice, so emails are counted per
  invoice without parsing them; the tutorial arm's emails carry Django's own Message-ID, so its
  events give each invoice a recipient of its own, which names it (``TUTORIAL_DOMAIN``).
* The workers are ``celery -A core worker --include
  bench.tasks,bench.floor_sender,bench.tutorial`` (``stack.launch``; the floor sender and the
  tutorial's task are reference arms), logging at WARNING as production does, each ready once
  it has set its key in Redis (``bench.tasks``); stopped together with a warm shutdown, then
  SIGKILL of each group, on the way out, on error or Ctrl-C too.

Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.run import RESULTS, RunConfig, stack_env, stack_pids, web
from bench.tasks import NOOP_COUNTER, READY_KEY
from stack import launch
from stack.process import Process, Ready, stop_all
from stack.smtp import Faults, Received, SmtpServer

# How often a benchmark waiting for emails checks its workers and looks for jobs whose publish
# at commit failed (the workers' relay publishes those after OUTBOX_RELAY_GRACE_SECONDS, 10 s).
CHECK_EVERY = 15.0


# --- What the SMTP server received -------------------------------------------------------------


# The recipients' domain of the tutorial arm's events: ``<provider invoice id>@<domain>``.
TUTORIAL_DOMAIN = "tutorial.example.com"


def provider_invoice_id(message_id: str) -> str:
    """The provider invoice id in an invoice email's Message-ID, ``<in_….<digest>@domain>``
    (``invoicing.tasks.invoice_email_message_id``)."""
    local = message_id.strip("<>").rpartition("@")[0]
    return local.rpartition(".")[0]


def email_invoice(received: Received) -> str:
    """The provider invoice id an email is for: named by its recipient in the tutorial arm,
    by its Message-ID otherwise."""
    local, _, domain = received.recipient.rpartition("@")
    return local if domain == TUTORIAL_DOMAIN else provider_invoice_id(received.message_id)


def emails_check(sink: SmtpServer, expected: Collection[str]) -> dict[str, Any]:
    """Exactly one email for each invoice in ``expected``, and none for any other."""
    emails = sink.handler.received()
    received = Counter(email_invoice(email) for email in emails)
    wanted = set(expected)
    missing = len(wanted - received.keys())
    duplicated = sum(1 for invoice in wanted if received[invoice] > 1)
    unexpected = sum(n for invoice, n in received.items() if invoice not in wanted)
    return {
        "invoices": len(wanted),
        "emails": len(emails),
        "missing": missing,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "ok": missing == duplicated == unexpected == 0 and len(emails) == len(wanted),
    }


# --- Celery workers ----------------------------------------------------------------------------


def _proc_field(path: str, name: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def rss_kib(pid: int) -> int | None:
    """Resident set size of one process, KiB (pages shared with other processes counted in
    full); None if it is gone."""
    return _proc_field(f"/proc/{pid}/status", "VmRSS:")


def pss_kib(pid: int) -> int | None:
    """Proportional set size of one process, KiB (each shared page divided among the
    processes sharing it: prefork pool processes share much of their parent's memory)."""
    return _proc_field(f"/proc/{pid}/smaps_rollup", "Pss:")


@dataclass
class Workers:
    processes: list[Process]

    def pids(self) -> list[int]:
        """Every worker's main process and its pool processes."""
        return [pid for process in self.processes for pid in process.pids()]

    def rss(self) -> dict[int, int]:
        """RSS (KiB) of every worker process, main and pool."""
        sizes = {pid: rss_kib(pid) for pid in self.pids()}
        return {pid: size for pid, size in sizes.items() if size is not None}

    def pss(self) -> dict[int, int]:
        """PSS (KiB) of every worker process, main and pool."""
        sizes = {pid: pss_kib(pid) for pid in self.pids()}
        return {pid: size for pid, size in sizes.items() if size is not None}

    def check(self) -> None:
        """Raise if a worker has exited."""
        for process in self.processes:
            process.check()


@contextlib.contextmanager
def celery_workers(
    run: RunConfig, *, env: Mapping[str, str], startup_timeout: float = 90.0
) -> Iterator[Workers]:
    """``run.workers.processes`` workers named ``<run>-w<i>@<host>``, consuming the queues
    every ``celery -A core worker`` consumes, with ``bench.tasks``, the floor sender
    (``bench.floor_sender``) and the tutorial's task (``bench.tutorial``) loaded; each logs to
    ``bench/results/<run>.worker<i>.log``."""
    client = redis.Redis.from_url(run.redis_url)
    processes: list[Process] = []

    def marked_ready(name: str) -> Ready:
        pattern = f"{run.prefix}{READY_KEY}{name}@*"
        return lambda _: any(True for _ in client.scan_iter(match=pattern, count=1000))

    try:
        for index in range(1, run.workers.processes + 1):
            name = f"{run.run_id}-w{index}"
            processes.append(
                launch.celery_worker(
                    env,
                    name=name,
                    pool=run.workers.pool,
                    concurrency=run.workers.concurrency,
                    include=("bench.tasks", "bench.floor_sender", "bench.tutorial"),
                    loglevel="WARNING",
                    ready=marked_ready(name),
                    log=RESULTS / f"{run.name}.worker{index}.log",
                )
            )
        deadline = time.monotonic() + startup_timeout
        for process in processes:
            process.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
        yield Workers(processes)
    finally:
        client.close()
        stop_all(processes, grace=15)


def noop_done(client: redis.Redis, prefix: str) -> int:
    """How many ``bench.noop`` tasks have run in this run."""
    return int(client.get(prefix + NOOP_COUNTER) or 0)


# --- The backend -------------------------------------------------------------------------------


@dataclass
class Backend:
    """The SMTP server and the Celery workers of a run, and the environment they share."""

    run: RunConfig
    sink: SmtpServer
    workers: Workers
    env: dict[str, str]
    redis: redis.Redis
    incidents: list[dict[str, Any]] = field(default_factory=list)
    publish_failures: int = 0  # jobs whose publish failed, as last recorded in ``incidents``
    # A broker of the run's own (bench.brokers: a RabbitMQ node): its name -> its processes,
    # counted in ``cpu_groups`` under that name.
    brokers: dict[str, Callable[[], list[int]]] = field(default_factory=dict)

    @property
    def emails(self) -> int:
        """Emails the SMTP server has taken so far."""
        return len(self.sink.handler.received())

    def wait_emails(self, total: int, timeout: float) -> None:
        """Wait until the sink has received ``total`` emails in all; raise after ``timeout``.

        Every ``CHECK_EVERY`` seconds meanwhile, and once at the end, look for jobs whose
        publish at commit failed (the broker stalled or was unreachable, which a neighbour on
        the shared Redis can cause): the workers' relay publishes them after its grace period,
        so the emails of those jobs waited that long. Each time more are found it is recorded
        in ``incidents``: the run's figures then include a broker stall."""
        started = time.perf_counter()
        deadline = started + timeout
        next_check = started + CHECK_EVERY
        while not self.sink.handler.wait_for(total, timeout=1.0):
            now = time.perf_counter()
            if now >= deadline:
                self.workers.check()
                raise RuntimeError(
                    f"{self.emails} of {total} emails after {timeout:.0f} s "
                    f"({stored(self.run.database_url)})"
                )
            if now >= next_check:
                self.workers.check()
                self.publish_failures_record()
                next_check = now + CHECK_EVERY
        self.publish_failures_record()

    def publish_failures_record(self) -> None:
        """Record an incident if more jobs than last time had a publish at commit fail."""
        failed = publish_failed(self.run.database_url)
        if failed <= self.publish_failures:
            return
        incident = {
            "at": time.strftime("%H:%M:%S"),
            "what": f"{failed - self.publish_failures} job(s) whose publish at commit failed "
            "(the broker stalled or refused): published by the workers' relay after its grace "
            "period",
        }
        self.publish_failures = failed
        self.incidents.append(incident)
        print(f"  WARNING: {incident['what']}", flush=True)

    def cpu_groups(self, server: Process) -> dict[str, list[int]]:
        """Processes by group for ``bench.run.cpu_snapshot``: ``client`` is this process,
        the load generator and the SMTP server together."""
        groups = stack_pids(gunicorn=server.pids(), database=self.run.database)
        owned = {name: pids() for name, pids in self.brokers.items()}
        return {**groups, "celery": self.workers.pids(), **owned}


@contextlib.contextmanager
def backend(
    run: RunConfig, *, settings: Mapping[str, str], smtp_delay: float = 0.0
) -> Iterator[Backend]:
    """The SMTP server and the workers, stopped (workers first) on the way out."""
    client = redis.Redis.from_url(run.redis_url)
    try:
        with SmtpServer(faults=Faults(delay=smtp_delay)) as sink:
            env = stack_env(run, smtp_port=sink.port, settings=settings)
            with celery_workers(run, env=env) as workers:
                yield Backend(run=run, sink=sink, workers=workers, env=env, redis=client)
    finally:
        client.close()


def serving(
    backend: Backend, *, settings: Mapping[str, str] | None = None, log: str = ""
) -> Process:
    """gunicorn with the backend's environment (plus ``settings``): ``bench.run.web``."""
    return web(
        {**backend.env, **(settings or {})}, backend.run.gunicorn, log=log or backend.run.name
    )


# --- What the pipeline stored ------------------------------------------------------------------


def stored(database_url: str) -> dict[str, int]:
    """What the pipeline left in PostgreSQL: ``outbox``, the job rows (the floor receiver
    writes its own published: ``bench.floor_receiver``), and those still waiting to be
    published."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            """
            SELECT (SELECT count(*) FROM webhooks_webhookevent),
                   (SELECT count(*) FROM invoicing_invoice),
                   (SELECT count(*) FROM asyncwork_job),
                   (SELECT count(*) FROM asyncwork_job
                      WHERE status = 'READY' AND published_at IS NULL),
                   (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sent'),
                   (SELECT count(*) FROM invoicing_emaildelivery WHERE state <> 'sent'),
                   (SELECT count(*) FROM asyncwork_deadletter)
            """
        ).fetchone()
    assert row is not None
    names = (
        "events",
        "invoices",
        "outbox",
        "outbox_unpublished",
        "emails_sent",
        "emails_not_sent",
        "dead_letters",
    )
    return dict(zip(names, (int(n) for n in row), strict=True))


def publish_failed(database_url: str) -> int:
    """Jobs whose publish failed at least once (each keeps the last failure's error)."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT count(*) FROM asyncwork_job WHERE last_error <> ''"
        ).fetchone()
    return int(row[0]) if row else 0


def stored_invoice_ids(database_url: str) -> set[str]:
    with psycopg.connect(database_url) as connection:
        rows = connection.execute("SELECT provider_invoice_id FROM invoicing_invoice").fetchall()
    return {row[0] for row in rows}


def pipeline_expected(total: int) -> dict[str, int]:
    """What ``stored`` must find after ``total`` new paid events went through: each stored
    once, published, emailed, nothing dead-lettered."""
    return {
        "events": total,
        "invoices": total,
        "outbox": total,
        "outbox_unpublished": 0,
        "emails_sent": total,
        "emails_not_sent": 0,
        "dead_letters": 0,
    }
