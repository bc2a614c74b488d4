"""The chaos suite across hosts (``python -m chaos --hosts``): each role on a host of its own,
and the network partitions between them (``stack.netns``).

Hosts (network namespaces on one switch of the run's own, ``10.x.y.0/24``):

* ``ctl``: the suite itself (the load, the observers, the fault injectors): the orchestrator
  moves its main thread there before it starts anything, so every thread and process it
  starts is born there and reaches the others through the switch;
* ``data``: PostgreSQL and Redis (the broker and the cache), each on an address of its own;
  with ``--broker rabbitmq``, the RabbitMQ node too (the broker), on an address of its own
  (Redis stays for the cache and the breaker);
* ``mail``: the fault-injecting SMTP server (its thread and socket are born there);
* ``web1``, ``web2``: gunicorn each, behind the nginx edge, which runs on ``ctl`` (as the
  production one, rendered by deploy/nginx/render.sh; a name in ``ctl``'s /etc/hosts resolves
  to both web hosts, and nginx balances over them);
* ``worker1`` .. ``worker3``: a Celery worker each;
* ``beat1``, ``beat2``: a beat each (one leads, one stands by).

The faults, each a partition (a silent drop, as ``stack.netns`` makes it):

* ``worker_host_cut``: the SMTP server holds the next DATA after committing it (inside the
  crash window); the worker host in that conversation is cut off from everything for longer
  than the claim lease and Redis's visibility timeout, then healed. The sends it cut are the
  messages the server accepted from that host while the link was down, or in the seconds
  before, that the database had not marked sent just after the cut; the sends it made
  after its lease lapsed (a zombie's) are the messages accepted from it after the heal for a
  claim it held before the cut.
* ``worker_db_cut``: a worker host mid-SMTP cut off from PostgreSQL alone (Redis and the SMTP
  server still reachable), for longer than the lease.
* ``web_broker_cut``: a web host cut off from the broker (Redis, or the RabbitMQ node) while
  the load runs: what it commits cannot be published; the jobs unpublished at the heal must
  be published by the workers' relay and run. (Every cut "from the broker" is from the
  broker's address.)
* ``beat_host_cut``: the leading beat's host (the one holding the ``beat-leader`` lock's
  session) cut off from everything; the standby must take over, and the old leader must
  dispatch nothing after the heal. Read from the beats' logs (they log at INFO here).
* ``data_flap``: the data host's link down 2 s, up 3 s, in a loop.

Every record says when the fault started and ended, and what the report needs to measure
its recovery (the invoices pending at its start, the jobs unpublished at its end).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from chaos import config
from chaos.faults import (
    BEAT_HOST_CUT,
    DATA_FLAP,
    WEB_BROKER_CUT,
    WORKER_DB_CUT,
    WORKER_HOST_CUT,
    Context,
    Step,
)
from chaos.observe import Db, pending_invoices, unpublished_jobs
from chaos.stack import (
    DATA_HOST,
    POSTGRES_SERVICE,
    RABBITMQ,
    RABBITMQ_SERVICE,
    REDIS,
    REDIS_SERVICE,
    Stack,
)
from stack import launch
from stack.netns import Topology
from stack.smtp import IN_WINDOW

CTL = "ctl"
MAIL = "mail"
WEB_HOSTS = ("web1", "web2")
WORKER_HOSTS = ("worker1", "worker2", "worker3")
BEAT_HOSTS = ("beat1", "beat2")
HOSTS = (CTL, DATA_HOST, MAIL, *WEB_HOSTS, *WORKER_HOSTS, *BEAT_HOSTS)

# The web hosts behind the edge: gunicorn on the same port of each, and one name (in the
# control host's /etc/hosts) that resolves to all of them, which nginx balances over.
WEB_NAME = "web"
WEB_PORT = 8000
# The edge's limits, far above the load: every sender here is one address (the control
# host's loopback), so the per-address limits are the global ones.
EDGE_LIMITS: dict[str, int] = {
    "WEBHOOK_EDGE_ADDRESS_RATE": 2000,
    "WEBHOOK_EDGE_ADDRESS_BURST": 2000,
    "WEBHOOK_EDGE_ADDRESS_CONNECTIONS": 64,
}
EDGE_RATE, EDGE_BURST, EDGE_IN_FLIGHT = 2000, 2000, 64

HOLD_SECONDS = 3.0
HOLD_WAIT = 30.0
BEFORE_CUT = 5.0  # seconds before a cut in which a message accepted may not have been marked
FLAP_DOWN, FLAP_UP = 2.0, 3.0
BEAT_POLL = 5  # asyncwork.contrib.periodic.beat.STANDBY_POLL_SECONDS


@contextlib.contextmanager
def behind_edge(stack: Stack, *, web_hosts: tuple[str, ...], workers: int) -> Iterator[int]:
    """gunicorn on each of ``web_hosts`` (``workers`` each) behind the nginx edge on the
    control host (``launch.edge``, rendered by deploy/nginx/render.sh as in production); the
    edge's port on the control host's loopback."""
    net = stack.net
    assert net is not None
    with contextlib.ExitStack() as running:
        addresses = [
            running.enter_context(stack.web(workers=workers, host=host, port=WEB_PORT))[0]
            for host in web_hosts
        ]
        net.hosts_file(CTL, {WEB_NAME: addresses})
        edge = running.enter_context(
            launch.edge(
                WEB_PORT,
                upstream_host=WEB_NAME,
                rate=EDGE_RATE,
                burst=EDGE_BURST,
                in_flight=EDGE_IN_FLIGHT,
                settings=EDGE_LIMITS,
                via=stack.via(CTL),
            )
        )
        yield edge.port


def topology(hosts: tuple[str, ...] = HOSTS, *, broker: str = REDIS) -> Topology:
    services = {POSTGRES_SERVICE: DATA_HOST, REDIS_SERVICE: DATA_HOST}
    if broker == RABBITMQ:
        services[RABBITMQ_SERVICE] = DATA_HOST
    return Topology(hosts, services=services)


def _net(ctx: Context) -> Topology:
    assert ctx.stack.net is not None, "a partition needs the hosts (--hosts)"
    return ctx.stack.net


def _host_in_smtp(ctx: Context, hosts: tuple[str, ...], seconds: float) -> tuple[str, str]:
    """Hold the next DATA (committed, 250 not sent) for ``seconds``: the host of the worker
    sending it, and its Message-ID; any of ``hosts`` if no DATA comes."""
    hold = ctx.smtp.handler.hold_next(IN_WINDOW, seconds)
    if not hold.reached.wait(HOLD_WAIT):
        ctx.smtp.handler.hold_cancel(hold)
        return hosts[ctx.rng.randrange(len(hosts))], ""
    host = _net(ctx).host_of(hold.peer)
    return (host if host in hosts else hosts[0]), hold.message_id


def _marked_sent(ctx: Context, message_ids: list[str]) -> set[str]:
    rows = ctx.db.rows(
        "SELECT message_id FROM invoicing_emaildelivery "
        "WHERE state = 'sent' AND message_id = ANY(%s)",
        (message_ids,),
    )
    return {r[0] for r in rows or ()}


def _accepted_from(ctx: Context, address: str, since: float, until: float) -> list[str]:
    return [
        r.message_id
        for r in ctx.smtp.handler.received()
        if r.peer == address and since <= r.at <= until
    ]


def _unpublished(ctx: Context) -> list[int]:
    return unpublished_jobs(ctx.db)


_CLAIMS_SQL = """
SELECT message_id, attempts FROM invoicing_emaildelivery
WHERE state = 'sending' AND split_part(claimed_by, ':', 2) = ANY(%s)
"""


def _claims_of(ctx: Context, host: str) -> list[dict[str, Any]]:
    """The claims the worker on ``host`` holds (its owner is ``<hostname>:<pid>:<token>``;
    the namespaces share one hostname, so it is known by its processes' pids)."""
    worker = ctx.workers.worker(WORKER_HOSTS.index(host))
    rows = ctx.db.rows(_CLAIMS_SQL, ([str(pid) for pid in worker.pids()],))
    return [{"message_id": m, "attempts": n} for m, n in rows or []]


def _cut_sends(ctx: Context, address: str, at: float, until: float, marked: set[str]) -> list[str]:
    """Messages accepted from ``address`` from just before the cut until ``until``, less those
    the database had marked sent just after the cut: sends whose sender could not mark them."""
    return sorted(
        {m for m in _accepted_from(ctx, address, at - BEFORE_CUT, until) if m not in marked}
    )


def _partition(
    ctx: Context, host: str, seconds: float, *, cut: Callable[[], None], heal: Callable[[], None]
) -> dict[str, Any]:
    """Cut a worker host (``cut``), note what it held and had marked (the database as it is
    once the host can no longer write to it), wait ``seconds``, heal it."""
    address = _net(ctx).address(host)
    pending = pending_invoices(ctx.db)
    at = time.time()
    cut()
    in_data = [
        s.message_id for s in ctx.smtp.handler.sessions_in_data().values() if s.peer == address
    ]
    claims = _claims_of(ctx, host)
    time.sleep(0.5)
    marked = _marked_sent(ctx, _accepted_from(ctx, address, at - BEFORE_CUT, at + 0.5))
    time.sleep(max(0.0, seconds - 0.5))
    heal()
    healed = time.time()
    sends_cut = _cut_sends(ctx, address, at, healed, marked)
    return {
        "at": at,
        "ended": healed,
        "host": host,
        "address": address,
        "sessions_in_data": in_data,
        "claims_at_cut": claims,
        "sends_cut": sends_cut,
        "sends_cut_in_window": len(sends_cut),
        "pending_invoices": pending,
        # The other hosts carry on while it is cut: recovery is measured from the cut.
        "recovery_from": "at",
        "lease_seconds": int(config.TIMING["EMAIL_CLAIM_LEASE_SECONDS"]),
    }


def worker_host_cut(ctx: Context, step: Step) -> dict[str, Any]:
    net = _net(ctx)
    host, held = _host_in_smtp(ctx, WORKER_HOSTS, HOLD_SECONDS)
    record = _partition(
        ctx, host, step.seconds, cut=lambda: net.cut(host), heal=lambda: net.heal(host)
    )
    return {**record, "held_message_id": held}


def worker_db_cut(ctx: Context, step: Step) -> dict[str, Any]:
    net = _net(ctx)
    host, held = _host_in_smtp(ctx, WORKER_HOSTS, 0.5)
    record = _partition(
        ctx,
        host,
        step.seconds,
        cut=lambda: net.cut_service(host, POSTGRES_SERVICE),
        heal=lambda: net.heal_service(host, POSTGRES_SERVICE),
    )
    return {**record, "held_message_id": held}


def web_broker_cut(ctx: Context, step: Step) -> dict[str, Any]:
    net = _net(ctx)
    host = WEB_HOSTS[0]
    service = ctx.stack.broker_service
    at = time.time()
    unpublished_before = len(_unpublished(ctx))
    net.cut_service(host, service)
    time.sleep(step.seconds)
    net.heal_service(host, service)
    healed = time.time()
    return {
        "at": at,
        "ended": healed,
        "host": host,
        "service": service,
        "unpublished_rows_before": unpublished_before,
        "unpublished_at_end": _unpublished(ctx),
    }


_LEADER_SQL = """
SELECT host(a.client_addr) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND a.application_name LIKE 'beat-leader%%'
"""


def _leaders(ctx: Context) -> list[str | None]:
    """The hosts whose beat session holds the leader lock, as PostgreSQL sees it."""
    return [_net(ctx).host_of(r[0]) for r in ctx.db.rows(_LEADER_SQL) or []]


def beat_host_cut(ctx: Context, step: Step) -> dict[str, Any]:
    net = _net(ctx)
    leaders = _leaders(ctx)
    leader = next((h for h in leaders if h in BEAT_HOSTS), None)
    if leader is None:
        return {"skipped": f"no beat holds the leader lock (sessions: {leaders})"}
    standby = next(h for h in BEAT_HOSTS if h != leader)
    at = time.time()
    net.cut(leader)
    took_over: float | None = None
    while time.time() < at + step.seconds:
        if took_over is None and standby in _leaders(ctx):
            took_over = time.time()
        time.sleep(0.5)
    net.heal(leader)
    healed = time.time()
    # Long enough for the old leader to tick after the heal and, if it were not fenced,
    # dispatch what it thinks is due.
    time.sleep(2 * BEAT_POLL + 2)
    return {
        "at": at,
        "ended": healed,
        "host": leader,
        "standby": standby,
        # When PostgreSQL showed the standby holding the lock (polled every 0.5 s).
        "takeover_seconds": round(took_over - at, 1) if took_over is not None else None,
        "leaders_after": _leaders(ctx),
    }


def data_flap(ctx: Context, step: Step) -> dict[str, Any]:
    net = _net(ctx)
    pending = pending_invoices(ctx.db)
    at = time.time()
    flap = net.flap(DATA_HOST, down=FLAP_DOWN, up=FLAP_UP, seconds=step.seconds)
    flap.join()
    ended = time.time()
    return {
        "at": at,
        "ended": ended,
        "host": DATA_HOST,
        "cuts": len(flap.cuts),
        "down_seconds": FLAP_DOWN,
        "up_seconds": FLAP_UP,
        "pending_invoices": pending,
    }


INJECTORS: dict[str, Callable[[Context, Step], dict[str, Any]]] = {
    WORKER_HOST_CUT: worker_host_cut,
    WORKER_DB_CUT: worker_db_cut,
    WEB_BROKER_CUT: web_broker_cut,
    BEAT_HOST_CUT: beat_host_cut,
    DATA_FLAP: data_flap,
}


# --- the beats' record, from their logs ---------------------------------------------------------

_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_DISPATCH = re.compile(_STAMP + r".*Scheduler: Sending due task (\S+)", re.MULTILINE)
_TOOK = re.compile(_STAMP + r".*beat took the leader lock", re.MULTILINE)


def _when(stamp: str) -> float:
    # naive: the beats log local time, which is ours too
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def beat_record(log_dir: Path) -> dict[str, dict[str, Any]]:
    """For each beat's log: when it took the leader lock, and what it dispatched when."""
    record: dict[str, dict[str, Any]] = {}
    for log in sorted(log_dir.glob("beat*.log")):
        text = log.read_text(errors="replace")
        record[log.stem] = {
            "took_lock": [_when(s) for s in _TOOK.findall(text)],
            "dispatches": [(_when(s), name) for s, name in _DISPATCH.findall(text)],
        }
    return record


def beat_analysis(
    faults: list[dict[str, Any]], log_dir: Path, intervals: dict[str, int], started: float
) -> dict[str, Any]:
    """What the beats did around each beat host cut, and over the whole run: slots that two
    beats dispatched (two dispatches of one periodic task by different beats less than half
    its interval apart)."""
    record = beat_record(log_dir)
    by_task: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for beat, seen in record.items():
        for at, name in seen["dispatches"]:
            by_task[name].append((at, beat))
    doubles = []
    for name, dispatches in by_task.items():
        every = intervals.get(name)
        if not every:
            continue
        dispatches.sort()
        for (t1, b1), (t2, b2) in itertools.pairwise(dispatches):
            if b1 != b2 and t2 - t1 < every / 2:
                doubles.append({"task": name, "at": round(t1 - started, 1), "beats": [b1, b2]})
    cuts = []
    for fault in faults:
        if fault["kind"] != BEAT_HOST_CUT or "skipped" in fault:
            continue
        old, new = f"beat-{fault['host']}", f"beat-{fault['standby']}"
        took = [t for t in record.get(new, {}).get("took_lock", []) if t >= fault["at"]]
        old_dispatches = record.get(old, {}).get("dispatches", [])
        # Fencing: once the standby leads, the old leader must dispatch nothing, during the
        # cut (it cannot reach the broker anyway) or after the heal.
        after_takeover = [name for t, name in old_dispatches if took and t >= took[0]]
        cuts.append(
            {
                "old_leader": old,
                "standby": new,
                "standby_took_over_after_seconds": (
                    round(took[0] - fault["at"], 1) if took else None
                ),
                "old_leader_dispatches_after_heal": sum(
                    t >= fault["ended"] for t, _ in old_dispatches
                ),
                "old_leader_dispatches_after_takeover": len(after_takeover),
                "old_leader_dispatched_after_takeover": sorted(set(after_takeover)),
            }
        )
    return {
        "dispatches": {beat: len(seen["dispatches"]) for beat, seen in record.items()},
        "slots_dispatched_twice": doubles,
        "beat_host_cuts": cuts,
    }


def zombie_sends(
    faults: list[dict[str, Any]], received: list[Any], final: dict[str, tuple[str, int]]
) -> list[dict[str, Any]]:
    """For each worker host cut: what became of the claims its worker held at the cut, and
    the messages it got accepted for them after its lease lapsed (the cut's start plus the
    lease): a zombie's sends. ``final``: each Message-ID's delivery state and claim token at
    the end of the run; a claim taken over has a higher token (the zombie's late writes are
    fenced on its own)."""
    out = []
    for fault in faults:
        if fault["kind"] != WORKER_HOST_CUT or "skipped" in fault:
            continue
        lapsed = fault["at"] + fault["lease_seconds"]
        held = {c["message_id"]: c["attempts"] for c in fault["claims_at_cut"]}
        late = [
            r
            for r in received
            if r.peer == fault["address"] and r.message_id in held and r.at >= lapsed
        ]
        out.append(
            {
                "host": fault["host"],
                "claims_held_at_cut": len(held),
                "claims_taken_over": sum(final.get(m, ("", 0))[1] > n for m, n in held.items()),
                "claims_sent_at_the_end": sum(final.get(m, ("", 0))[0] == "sent" for m in held),
                "sends_after_lease_lapsed": len(late),
                "message_ids": sorted({r.message_id for r in late}),
            }
        )
    return out


# Beyond its 5 s poll, the standby waits for PostgreSQL to drop the cut leader's session
# (asyncwork.contrib.periodic.beat: keepalives, about 20 s).
TAKEOVER_BOUND = 30.0


def analysis(
    *,
    net: Topology,
    faults: list[dict[str, Any]],
    log_dir: Path,
    received: list[Any],
    started: float,
    db: Db,
) -> dict[str, Any]:
    """The report's section on the hosts, with the goals only a multi-host run has."""
    beats = beat_analysis(faults, log_dir, config.INTERVALS, started)
    held = [c["message_id"] for f in faults for c in f.get("claims_at_cut", [])]
    rows = db.rows(
        "SELECT message_id, state, attempts FROM invoicing_emaildelivery "
        "WHERE message_id = ANY(%s)",
        (held,),
    )
    final = {m: (state, n) for m, state, n in rows or []}
    cuts = beats["beat_host_cuts"]
    return {
        "topology": net.describe(),
        "beats": beats,
        "zombie_sends": zombie_sends(faults, received, final),
        "goals": {
            "no_slot_dispatched_by_two_beats": not beats["slots_dispatched_twice"],
            "standby_beat_took_over_within_bound": bool(cuts)
            and all(
                c["standby_took_over_after_seconds"] is not None
                and c["standby_took_over_after_seconds"] <= TAKEOVER_BOUND
                for c in cuts
            ),
            "old_beat_leader_dispatched_nothing_after_takeover": all(
                c["old_leader_dispatches_after_takeover"] == 0 for c in cuts
            ),
        },
    }
