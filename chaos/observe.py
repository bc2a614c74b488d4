"""Watching the system from outside: its database, its broker, the SMTP server's record.

Nothing here goes through the application's code: the database is read with plain SQL on the
application's tables, the broker with plain Redis commands (or plain AMQP on RabbitMQ), so
what the suite reports does
not depend on the code under test being right. Every probe is bounded (a short connect and
statement timeout) and answers None while its dependency is down, since faults take them
down on purpose.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import amqp
import psycopg
import redis

# The email task's module path: what its job rows and dead letters name.
EMAIL_TASK = "invoicing.tasks.send_invoice_email"
EMAIL_QUEUE = "email"
# A job published again (a retry, a rescued run, one the relay sent late) waits here on Redis,
# ahead of its queue (asyncwork.broker); on RabbitMQ it goes to the queue itself.
EMAIL_RECOVERY_QUEUE = "email-recovery"
DEFAULT_QUEUE = "default"
DEFAULT_RECOVERY_QUEUE = "default-recovery"
# kombu's Redis transport keeps priority n>0 of queue q in "q\x06\x16n" (Channel._q_for_pri).
_PRIORITY_STEPS = (0, 3, 6, 9)


class Db:
    """One autocommit connection, reopened after a failure; queries answer None when down."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def rows(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any] | None:
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(
                        self.url,
                        autocommit=True,
                        connect_timeout=2,
                        options="-c statement_timeout=10000",
                    )
                return self._conn.execute(sql, params).fetchall()
            except psycopg.Error:
                self.close()
                return None

    def value(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        rows = self.rows(sql, params)
        return rows[0][0] if rows else None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None


class Broker:
    """Queue depths on the suite's Redis (the Celery broker is its database 0)."""

    def __init__(self, port: int, prefix: str = "", host: str = "127.0.0.1") -> None:
        self.client = redis.Redis(
            host=host, port=port, db=0, socket_timeout=1, socket_connect_timeout=1
        )
        self.prefix = prefix

    def depth(self, queue: str) -> int | None:
        keys = [self.prefix + (f"{queue}\x06\x16{s}" if s else queue) for s in _PRIORITY_STEPS]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.llen(key)
                return sum(int(n) for n in pipe.execute())
        except redis.RedisError:
            return None

    def depths(self, *queues: str) -> int | None:
        """The sum of ``depth`` over ``queues``; None if any is unknown."""
        found = [self.depth(queue) for queue in queues]
        return None if None in found else sum(n or 0 for n in found)

    def unacked(self) -> int | None:
        try:
            return int(self.client.hlen(self.prefix + "unacked"))
        except redis.RedisError:
            return None


class RabbitBroker:
    """Queue depths on the suite's RabbitMQ node: the messages ready in each queue, by a
    passive declaration on a connection of the observer's own (a queue that is not declared
    holds nothing: the recovery queue is folded into the email queue there). Messages held
    unacknowledged are not known without the management plugin: None."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._conn: amqp.Connection | None = None
        self._channel: Any = None
        self._lock = threading.Lock()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.collect()
        self._conn = self._channel = None

    def depth(self, queue: str) -> int | None:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = amqp.Connection(
                        host=f"{self.host}:{self.port}",
                        userid="guest",
                        password="guest",  # noqa: S106 - the suite's own node, on loopback
                        connect_timeout=1,
                        read_timeout=2,
                        write_timeout=2,
                    )
                    self._conn.connect()
                if self._channel is None or not self._channel.is_open:
                    self._channel = self._conn.channel()
                _, count, _ = self._channel.queue_declare(queue, passive=True)
                return int(count)
            except amqp.exceptions.NotFound:
                self._channel = None  # the broker closed it
                return 0
            except Exception:  # noqa: BLE001 - down, stalled or restarting: unknown
                self._close()
                return None

    def depths(self, *queues: str) -> int | None:
        found = [self.depth(queue) for queue in queues]
        return None if None in found else sum(n or 0 for n in found)

    def unacked(self) -> int | None:
        return None


# Paid invoices without a sent email and without a dead letter: the email backlog.
PENDING_SQL = f"""
SELECT i.id FROM invoicing_invoice i
WHERE i.status = 'paid'
  AND NOT EXISTS (SELECT 1 FROM invoicing_emaildelivery d
                  WHERE d.invoice_id = i.id AND d.state = 'sent')
  AND NOT EXISTS (SELECT 1 FROM asyncwork_deadletter l
                  WHERE l.task = '{EMAIL_TASK}'
                    AND l.args = jsonb_build_array(i.id))
"""  # noqa: S608 - no input: a constant of this module

# Jobs waiting to be published: READY, never published or published no more (a retry, a
# rescued run), whether due now or later.
UNPUBLISHED_SQL = (
    "SELECT id FROM asyncwork_job WHERE status = 'READY' AND published_at IS NULL ORDER BY id"
)

_SAMPLE_SQL = """
SELECT (SELECT count(*) FROM invoicing_invoice WHERE status = 'paid'),
       (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sent'),
       (SELECT count(*) FROM invoicing_emaildelivery WHERE state = 'sending'),
       (SELECT count(*) FROM asyncwork_job WHERE status = 'READY' AND published_at IS NULL
          AND (due_at IS NULL OR due_at <= now())),
       (SELECT count(*) FROM asyncwork_job WHERE status = 'RUNNING'),
       (SELECT count(*) FROM asyncwork_deadletter)
"""


@dataclass
class Sources:
    """What the observer reads: the database, the broker, and two counters of the
    orchestrator's (messages the SMTP server accepted, events the webhook acknowledged)."""

    db: Db
    broker: Broker | RabbitBroker
    smtp_accepted: Callable[[], int]
    events_acknowledged: Callable[[], int]


class Timeline:
    """Samples the system every ``interval`` seconds in a thread of its own."""

    def __init__(self, sources: Sources, interval: float = 1.0) -> None:
        self.sources = sources
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> dict[str, Any]:
        s = self.sources
        row = s.db.rows(_SAMPLE_SQL)
        paid, sent, sending, unpublished, running, dead = row[0] if row else (None,) * 6
        return {
            "at": time.time(),
            "paid": paid,
            "sent": sent,
            "sending": sending,
            "jobs_due_unpublished": unpublished,
            "jobs_running": running,
            "dead_letters": dead,
            "email_queue": s.broker.depths(EMAIL_RECOVERY_QUEUE, EMAIL_QUEUE),
            "unacked": s.broker.unacked(),
            "smtp_accepted": s.smtp_accepted(),
            "events_acknowledged": s.events_acknowledged(),
        }

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.sample())


def pending_invoices(db: Db) -> list[int] | None:
    rows = db.rows(PENDING_SQL)
    return None if rows is None else [r[0] for r in rows]


def unpublished_jobs(db: Db) -> list[int]:
    """The jobs waiting to be published now (``UNPUBLISHED_SQL``); none if the database is
    down."""
    return [r[0] for r in db.rows(UNPUBLISHED_SQL) or []]


@dataclass(frozen=True)
class Facts:
    """The database's account of the run, read once the system is quiet."""

    invoices: dict[int, tuple[str, str]]  # pk -> (provider invoice id, status)
    deliveries: dict[int, dict[str, Any]]  # invoice pk -> its email's key row
    dead_letters: list[dict[str, Any]]
    email_jobs_per_invoice: dict[int, int]  # email jobs enqueued, per invoice pk
    # job id -> when it finished (successful or failed; None: not yet), for the jobs a fault
    # left unpublished
    finished_at: dict[int, float | None]
    jobs: list[dict[str, Any]]


def _epoch(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def facts_collect(db: Db, *, job_ids: list[int]) -> Facts:
    def rows(sql: str, params: Sequence[Any] = ()) -> list[Any]:
        found = db.rows(sql, params)
        if found is None:
            raise RuntimeError("the chaos database did not answer")
        return found

    invoices = {
        pk: (provider_id, status)
        for pk, provider_id, status in rows(
            "SELECT id, provider_invoice_id, status FROM invoicing_invoice"
        )
    }
    deliveries = {
        invoice_pk: {
            "state": state,
            "message_id": message_id,
            "attempts": attempts,
            "sent_at": _epoch(sent_at),
        }
        for invoice_pk, state, message_id, attempts, sent_at in rows(
            "SELECT invoice_id, state, message_id, attempts, sent_at "
            "FROM invoicing_emaildelivery WHERE key LIKE 'invoice_email_sent:%%'"
        )
    }
    dead_letters = [
        {
            "id": pk,
            "task": task,
            "invoice_pk": args[0] if task == EMAIL_TASK and args else None,
            "reason": reason,
            "exception": message[:300],
            "attempts": attempts,
            "created_at": _epoch(created_at),
            "replayed": replayed_at is not None,
        }
        for pk, task, args, reason, message, attempts, created_at, replayed_at in rows(
            "SELECT id, task, args, reason, exception_message, attempts, created_at, replayed_at "
            "FROM asyncwork_deadletter ORDER BY id"
        )
    ]
    email_jobs = {
        int(invoice_pk): count
        for invoice_pk, count in rows(
            "SELECT args->>0, count(*) FROM asyncwork_job WHERE task = %s GROUP BY 1", [EMAIL_TASK]
        )
    }
    finished_at = {
        pk: _epoch(at)
        for pk, at in rows(
            "SELECT id, finished_at FROM asyncwork_job WHERE id = ANY(%s)", [job_ids]
        )
    }

    jobs = [
        {"name": name, "runs": runs, "skips": skips, "last_error": last_error[:300]}
        for name, runs, skips, last_error in rows(
            "SELECT name, runs, skips, last_error FROM asyncwork_scheduledjob ORDER BY name"
        )
    ]
    return Facts(invoices, deliveries, dead_letters, email_jobs, finished_at, jobs)


# Celery's warning when a worker that lost its broker connection terminates a running
# acks_late task (worker_cancel_long_running_tasks_on_connection_loss).
_SELF_TERMINATION = re.compile(r"Task \S+\[(\S+)\] cannot be acknowledged after a connection loss")


# Celery's error when a worker cannot acknowledge (or reject) a finished task's message.
_FAILED_ACK = re.compile(r"Couldn't (?:ack|reject) ")


def worker_failed_acks(log_dir: Path) -> dict[str, int]:
    """For each worker's log, how many acknowledgements (or rejections) failed."""
    counts = {
        log.stem: len(_FAILED_ACK.findall(log.read_text(errors="replace")))
        for log in sorted(log_dir.glob("worker*.log"))
    }
    return {worker: n for worker, n in counts.items() if n}


def worker_self_terminations(log_dir: Path) -> list[str]:
    """Task ids the workers terminated themselves after losing the broker, from their logs."""
    found: list[str] = []
    for log in sorted(log_dir.glob("worker*.log")):
        found += _SELF_TERMINATION.findall(log.read_text(errors="replace"))
    return found


# A task's outcome, as Celery's trace logger words it, on a line starting with the text
# formatter's timestamp ("2026-01-31 12:00:00,123 ...").
_OUTCOME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\] (?:succeeded in|retry:|raised) ",
    re.MULTILINE,
)


def worker_outcomes(log_dir: Path) -> dict[str, list[float]]:
    """For each worker's log, when its tasks finished (succeeded, retried or failed), from
    the log lines; empty when the log format is not the text one."""
    return {
        log.stem: [
            # naive: the workers log local time, which is ours too
            datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for stamp in _OUTCOME.findall(log.read_text(errors="replace"))
        ]
        for log in sorted(log_dir.glob("worker*.log"))
    }


# What the safety nets log when they act, in the text format: each worker's poll relays
# (asyncwork.backend), rescues (asyncwork.rescue) and publishes again what the broker lost
# (asyncwork.recovery).
_RELAYED = re.compile(r" relay published (\d+) job\(s\)")
_RESCUED = re.compile(r" rescue (\S+): (\d+) ")
_REPUBLISHED = re.compile(r" the broker lost its messages: (\d+) job\(s\)")


@dataclass(frozen=True)
class NetActions:
    """What the safety nets did during an arm, from the processes' logs."""

    relayed: int  # jobs the relay published: come due (a retry, a rescued run), or left behind
    rescued: dict[str, int]  # rescue -> jobs (or an app's claims) of dead workers given back
    broker_losses: int  # times a worker saw the broker lose its messages (restart, flush)
    republished: int  # jobs those workers published again then


def net_actions(log_dir: Path) -> NetActions:
    """Sum, over every process's log in ``log_dir``, the counts the safety nets log."""
    relayed = 0
    rescued: dict[str, int] = {}
    losses = republished = 0
    for log in sorted(log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        relayed += sum(int(count) for count in _RELAYED.findall(text))
        for name, count in _RESCUED.findall(text):
            rescued[name] = rescued.get(name, 0) + int(count)
        counts = _REPUBLISHED.findall(text)
        losses += len(counts)
        republished += sum(int(count) for count in counts)
    return NetActions(
        relayed=relayed,
        rescued=dict(sorted(rescued.items())),
        broker_losses=losses,
        republished=republished,
    )
