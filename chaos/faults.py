"""The faults, injected while the load runs and after it, one at a time, in plan order.

Each injector returns a record of what it did, with absolute times (``time.time()``) and the
ids the report needs to measure recovery afterwards from the database and the SMTP record:

* ``worker_kill``: asks the SMTP server to hold the next DATA (``in_window``: after the
  message is committed, before the 250; ``outside``: a DATA that will be answered 451), finds
  the worker whose process holds that session's socket, snapshots every session of that
  worker inside DATA, SIGKILLs the worker's whole process group and starts a new worker. The
  sends it cut inside the crash window are read once the SMTP server has seen that worker's
  sessions close: those whose message was committed and whose reply was never read (with a
  kept connection, that may be a message accepted just before the kill, no longer inside
  DATA), less those already marked sent.
* ``relay_kill``: stalls the broker briefly so the on-commit publishes fail and leave jobs
  unpublished, runs the real relay (``asyncwork.backend.relay``, what every worker's poll runs,
  in ``chaos.relay_probe``), and SIGKILLs it once it has published messages whose rows it has
  not marked; checks that the rows were left unmarked.
* ``broker_stall``: ``CLIENT PAUSE <ms> ALL`` on the suite's Redis; on RabbitMQ the node is
  stopped (SIGSTOP) for as long, then resumed.
* ``redis_restart``: ``SHUTDOWN NOSAVE`` (every queued and unacknowledged message is gone;
  the depths are recorded), then the same server is started again on the same port. With
  RabbitMQ as the broker the plan's Redis restart is a ``rabbitmq_restart`` instead: the node
  stopped cleanly and started again on its data (its durable queues and persistent messages
  survive; the messages ready before and after are recorded).
* ``postgres_restart``: ``pg_ctl restart -m fast`` of the suite's cluster.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chaos.load import Sender
from chaos.observe import (
    DEFAULT_QUEUE,
    DEFAULT_RECOVERY_QUEUE,
    EMAIL_QUEUE,
    EMAIL_RECOVERY_QUEUE,
    Broker,
    Db,
    RabbitBroker,
    pending_invoices,
    unpublished_jobs,
)
from chaos.stack import Stack, WorkerPool, tcp_ports
from stack.net import wait_until
from stack.smtp import InData, SmtpServer

WORKER_KILL = "worker_kill"
RELAY_KILL = "relay_kill"
BROKER_STALL = "broker_stall"
REDIS_RESTART = "redis_restart"
RABBITMQ_RESTART = "rabbitmq_restart"
POSTGRES_RESTART = "postgres_restart"
# Across hosts: the partitions (chaos.hosts).
WORKER_HOST_CUT = "worker_host_cut"
WORKER_DB_CUT = "worker_db_cut"
WEB_BROKER_CUT = "web_broker_cut"
BEAT_HOST_CUT = "beat_host_cut"
DATA_FLAP = "data_flap"

HOLD_SECONDS = 3.0  # how long the SMTP server holds the DATA the kill lands in
HOLD_WAIT = 30.0  # how long a kill waits for a DATA to land in (none: emails are not flowing)
RESTART_DELAY = 1.0  # seconds a killed worker stays down
CUT_SEEN_WITHIN = 2.0  # seconds for the SMTP server to see a killed worker's sessions close
REDIS_DOWN_SECONDS = 1.0
RELAY_STALL_SECONDS = 1.5  # short enough that workers do not notice, long enough for publishes
RELAY_FREEZE_AFTER = 3  # publishes before the relay is frozen and killed


@dataclass(frozen=True)
class Step:
    """Start ``kind`` once ``at`` of the deliveries are done (1.0: after the load)."""

    at: float
    kind: str
    window: str = ""  # worker_kill: stack.smtp.IN_WINDOW or OUTSIDE
    seconds: float = 0.0  # broker_stall, a partition: how long
    after: float | None = None  # seconds after the previous fault ended; None: the runner's gap


@dataclass
class Context:
    stack: Stack
    workers: WorkerPool
    smtp: SmtpServer
    db: Db
    broker: Broker | RabbitBroker
    sender: Sender
    rng: random.Random
    relay_kills: int = 0


def worker_kill(ctx: Context, step: Step) -> dict[str, Any]:
    handler = ctx.smtp.handler
    hold = handler.hold_next(step.window, HOLD_SECONDS)
    if not hold.reached.wait(HOLD_WAIT):
        handler.hold_cancel(hold)
        return {"skipped": f"no DATA reached the SMTP server within {HOLD_WAIT:.0f} s"}
    sessions = handler.sessions_in_data()
    pid_index = ctx.workers.pid_index()
    ports = tcp_ports(list(pid_index))
    owner = ports.get(hold.peer_port)
    index = pid_index.get(owner or 0, ctx.rng.randrange(len(ctx.workers)))
    worker = ctx.workers.worker(index)
    group = set(worker.pids())
    killed_ports = {port for port, pid in ports.items() if pid in group}
    victims = [
        {"message_id": s.message_id, "recipient": s.recipient, "state": s.state}
        for port, s in sessions.items()
        if port in killed_ports
    ]
    killed_at = time.time()
    worker.kill()
    closed, cut = _sends_cut(ctx, killed_ports, since=killed_at)
    # A message committed after the snapshot (the worker's other sessions carry on until the
    # kill) is cut as well: the server saw its session vanish with no reply read.
    seen = {v["message_id"] for v in victims}
    victims += [
        {"message_id": c.message_id, "recipient": c.recipient, "state": "committed"}
        for c in cut
        if c.message_id not in seen
    ]
    time.sleep(RESTART_DELAY)
    replacement = ctx.workers.restart(index)
    return {
        "window": step.window,
        "at": killed_at,
        "ended": killed_at,
        "worker": worker.name,
        "restarted_as": replacement.name,
        "target_found": owner in pid_index,
        "held_message_id": hold.message_id,
        "sessions_in_data": victims,
        "sessions_cut": [c.message_id for c in closed],
        "sends_cut": [c.message_id for c in cut],
        "in_crash_window": bool(cut),
        "sends_cut_in_window": len(cut),
    }


def _sends_cut(ctx: Context, ports: set[int], *, since: float) -> tuple[list[InData], list[InData]]:
    """The sessions a kill cut after their message was committed, and of those the sends it cut
    inside the crash window, known exactly once the SMTP server has seen
    the killed worker's sessions close: each session of those ``ports`` that vanished after
    the server committed its message (no RSET, MAIL or QUIT: its 250 was never read), less the
    messages the database already has marked sent (a kept connection whose worker marked its
    last message and sat idle is cut with nothing left to resend). Nobody can mark a dead
    owner's claim before its heartbeat lapses, so what the database says just after the kill
    is what the worker had done before it."""
    handler = ctx.smtp.handler
    wait_until(lambda: not ports & handler.sessions_in_data().keys(), timeout=CUT_SEEN_WITHIN)
    with handler.lock:
        cuts = [c for at, c in handler.cuts if at >= since and c.port in ports]
    if not cuts:
        return [], []
    sent = ctx.db.rows(
        "SELECT message_id FROM invoicing_emaildelivery "
        "WHERE state = 'sent' AND message_id = ANY(%s)",
        ([c.message_id for c in cuts],),
    )
    marked = {row[0] for row in sent or ()}
    return cuts, [c for c in cuts if c.message_id not in marked]


def _read_lines(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put("")  # end of output


def relay_kill(ctx: Context, step: Step) -> dict[str, Any]:
    ctx.relay_kills += 1
    probe = ctx.stack.relay_probe(f"relay-probe-{ctx.relay_kills}", freeze_after=RELAY_FREEZE_AFTER)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(probe.stdout, lines), daemon=True).start()
    published: list[int] = []
    outcome = "no output"
    killed_at: float | None = None
    unpublished_before: int | None = None
    try:
        if lines.get(timeout=60) != "ready":
            raise RuntimeError("the relay probe did not start")
        ctx.stack.broker_pause(RELAY_STALL_SECONDS)
        time.sleep(RELAY_STALL_SECONDS + 0.1)
        unpublished_before = len(unpublished_jobs(ctx.db))
        probe.stdin.write("go\n")
        probe.stdin.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                outcome = "timed out"
                break
            if line.startswith("published job-"):
                published.append(int(line.rpartition("-")[2]))
            elif line == "frozen":
                probe.kill()  # SIGKILL of its process group
                killed_at = time.time()
                outcome = "killed"
                break
            elif line in ("finished", ""):  # ran out of rows first, or exited
                outcome = line or "exited"
                break
            # anything else is the relay command's own output
    finally:
        probe.kill()
    unmarked: list[int] = []
    if killed_at is not None:
        time.sleep(0.5)  # PostgreSQL rolls the dead session's transaction back
        # Rows the probe published are locked by it until it dies, so a mark on one of them is
        # another relay's, after the kill; no mark (or that one) proves the kill came between.
        # (A job run from the probe's message meanwhile keeps no mark: its claim waited for the
        # probe's lock, and a job that ran is not published again.)
        rows = ctx.db.rows(
            "SELECT id FROM asyncwork_job WHERE id = ANY(%s) "
            "AND (published_at IS NULL OR published_at > to_timestamp(%s))",
            [published, killed_at],
        )
        unmarked = [r[0] for r in rows or []]
    return {
        "at": killed_at or time.time(),
        "ended": killed_at or time.time(),
        "outcome": outcome,
        "unpublished_rows_before": unpublished_before,
        "published_before_kill": published,
        "left_unmarked": unmarked,
        "landed": bool(unmarked),
    }


def broker_stall(ctx: Context, step: Step) -> dict[str, Any]:
    ctx.stack.broker_pause(step.seconds)
    started = time.time()
    time.sleep(step.seconds)
    while not ctx.stack.broker_answers():
        time.sleep(0.05)
    ended = time.time()
    return {
        "at": started,
        "ended": ended,
        "seconds": round(ended - started, 2),
        "unpublished_at_end": unpublished_jobs(ctx.db),
    }


def redis_restart(ctx: Context, step: Step) -> dict[str, Any]:
    assert ctx.stack.redis is not None
    # Restart with work in the queue, when there is some to be had: that is what it drops.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (ctx.broker.depth(EMAIL_QUEUE) or 0) < 5:
        time.sleep(0.2)
    queued = (
        ctx.broker.depths(EMAIL_RECOVERY_QUEUE, EMAIL_QUEUE, DEFAULT_RECOVERY_QUEUE, DEFAULT_QUEUE)
        or 0
    )
    unacked = ctx.broker.unacked()
    pending = pending_invoices(ctx.db)
    started = time.time()
    ctx.stack.redis.shutdown_nosave()
    time.sleep(REDIS_DOWN_SECONDS)
    ctx.stack.redis.start()
    return {
        "at": started,
        "ended": time.time(),
        "queued_messages_dropped": queued,
        "unacked_messages_dropped": unacked,
        "pending_invoices": pending,
    }


def rabbitmq_restart(ctx: Context, step: Step) -> dict[str, Any]:
    assert ctx.stack.rabbit is not None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (ctx.broker.depth(EMAIL_QUEUE) or 0) < 5:
        time.sleep(0.2)
    queued = ctx.broker.depths(EMAIL_QUEUE, DEFAULT_QUEUE) or 0
    pending = pending_invoices(ctx.db)
    started = time.time()
    ctx.stack.rabbit.stop()
    time.sleep(REDIS_DOWN_SECONDS)
    ctx.stack.rabbit.start()
    return {
        "at": started,
        "ended": time.time(),
        "queued_messages_before": queued,
        "queued_messages_after": ctx.broker.depths(EMAIL_QUEUE, DEFAULT_QUEUE),
        "pending_invoices": pending,
    }


def postgres_restart(ctx: Context, step: Step) -> dict[str, Any]:
    assert ctx.stack.postgres is not None
    pending = pending_invoices(ctx.db)
    started = time.time()
    ctx.stack.postgres.restart()
    return {"at": started, "ended": time.time(), "pending_invoices": pending}


# The faults whose recovery a profile's ``recovery_bound`` bounds.
BOUNDED_FAULTS = (WORKER_KILL, REDIS_RESTART, RABBITMQ_RESTART, POSTGRES_RESTART)

INJECTORS: dict[str, Callable[[Context, Step], dict[str, Any]]] = {
    WORKER_KILL: worker_kill,
    RELAY_KILL: relay_kill,
    BROKER_STALL: broker_stall,
    REDIS_RESTART: redis_restart,
    RABBITMQ_RESTART: rabbitmq_restart,
    POSTGRES_RESTART: postgres_restart,
}


class FaultRunner:
    """Runs the plan in a thread: each step once its share of the load is done, and at least
    ``gap`` seconds after the previous fault ended; after a bounded fault, at least ``isolate``
    seconds (the recovery bound), so that each bounded recovery is measured with no other fault
    inside it. ``injectors`` adds kinds of the caller's (the partitions of ``chaos.hosts``)."""

    def __init__(
        self,
        ctx: Context,
        steps: tuple[Step, ...],
        load_done: threading.Event,
        gap: float,
        isolate: float | None = None,
        injectors: dict[str, Callable[[Context, Step], dict[str, Any]]] | None = None,
    ) -> None:
        self.injectors = {**INJECTORS, **(injectors or {})}
        self.ctx = ctx
        self.steps = steps
        self.load_done = load_done
        self.gap = gap
        self.isolate = isolate
        self.records: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def start(self) -> FaultRunner:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise RuntimeError("a fault injector failed") from self.error

    def _run(self) -> None:
        try:
            last_end, wait = 0.0, self.gap
            for step in self.steps:
                while not (
                    self.load_done.is_set() or (step.at < 1 and self.ctx.sender.progress >= step.at)
                ):
                    time.sleep(0.1)
                pause = wait if step.after is None else step.after
                time.sleep(max(0.0, last_end + pause - time.time()))
                record = {"kind": step.kind, **self.injectors[step.kind](self.ctx, step)}
                record["during_load"] = not self.load_done.is_set()
                self.records.append(record)
                last_end = float(record.get("ended", time.time()))
                wait = self.gap
                if self.isolate is not None and step.kind in BOUNDED_FAULTS:
                    wait = max(self.gap, self.isolate)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join() in the main thread
            self.error = exc
