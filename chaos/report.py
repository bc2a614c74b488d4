"""The report of one arm: every figure, how it is computed, and whether the goals are met.

The customer's view is the SMTP server's record (what was accepted for delivery); the
system's view is its database. Each metric's definition is written into the JSON as well
(``DEFINITIONS``), so a report can be read without this file.

Goals (the exit code). Safe arm: nothing lost (and nothing acknowledged left unstored);
every refused recipient dead-lettered and every dead letter a permanent refusal; duplicates no
more than the sends our kills cut inside the crash window, each duplicate carrying its
invoice's one Message-ID; nothing marked sent that was not delivered; every relay kill landed
between a publish and its mark (a fault that did not land proves nothing); in a profile with
a ``recovery_bound``, the work hit by every worker kill, broker restart and PostgreSQL restart
done within it; no worker idle for more than ``STALL_GAP`` seconds while emails waited. Control arm:
at least one loss. Reported beside the goals, not part of them: whether every fault recovered
(the relay kills and the broker stall have no bound), the processes that died by themselves
(restarted, as a process manager would), the tasks workers terminated themselves on broker
loss, and what each safety net did (from the processes' logs).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chaos import config
from chaos.faults import (
    BOUNDED_FAULTS,
    BROKER_STALL,
    POSTGRES_RESTART,
    RABBITMQ_RESTART,
    REDIS_RESTART,
    RELAY_KILL,
    WORKER_KILL,
)
from chaos.load import Plan, Sender
from chaos.observe import Facts, NetActions
from chaos.stack import Exit
from stack.machine import describe, revision
from stack.smtp import Received, SmtpServer

DEFINITIONS = {
    "invoices_paid": "invoices stored as paid in the database, plus any invoice the sender "
    "got a 2xx for (a 2xx for an invoice not stored is counted in acknowledged_not_stored)",
    "emails_delivered": "invoices with at least one message accepted by the SMTP server / "
    "messages accepted in all",
    "lost": "paid invoices with a deliverable recipient and no message accepted by the SMTP "
    "server, plus invoices acknowledged with a 2xx but not stored as paid",
    "duplicates": "invoices with more than one accepted message; extra_messages counts every "
    "message after the first; same_message_id: every message of the invoice carries one "
    "Message-ID, the one in the database",
    "sends_cut_in_window_by_kills": "sessions of a killed worker that the SMTP server saw "
    "vanish after it committed their message (the reply never read: the crash window, "
    "accepted and not yet marked sent), less those the database had marked sent just after "
    "the kill (a kept connection sitting idle after its worker marked its last message)",
    "unattributed_cuts": "sessions the SMTP server saw vanish (closed without QUIT) after it "
    "committed their message, not cut by one of our kills",
    "dead_letters.permanent_refusal": "reason 'permanent', for an invoice whose recipient the "
    "SMTP server refuses with 550, with the refusal in the exception",
    "recovery.worker_kill": "seconds from the SIGKILL until the email of every invoice whose "
    "send the kill cut is marked sent (or dead-lettered) in the database",
    "recovery.relay_kill": "seconds from the SIGKILL until every job the killed relay had "
    "published but not marked has run to its end (successful or failed), from its message or "
    "from the workers' relay publishing it again",
    "recovery.broker_stall": "seconds from the end of the stall until every job waiting to be "
    "published at that moment (its publish at commit failed, or a retry waits) has run to its "
    "end (successful or failed)",
    "recovery.redis_restart": "seconds from Redis answering again until every invoice that was "
    "paid and had no email (nor dead letter) when Redis went down has one",
    "recovery.rabbitmq_restart": "seconds from the RabbitMQ node taking connections again until "
    "every invoice that was paid and had no email (nor dead letter) when it went down has one",
    "recovery.postgres_restart": "seconds from PostgreSQL accepting again until every invoice "
    "that was paid and had no email when it went down has one",
    "recovery.worker_host_cut": "seconds from the cut (a worker host cut off from every other "
    "host) until every invoice paid and without its email at the cut has one (or a dead "
    "letter): the other hosts recover it while the host is still cut",
    "recovery.worker_db_cut": "as worker_host_cut, the host cut off from PostgreSQL alone",
    "recovery.web_broker_cut": "seconds from the heal until every job waiting to be published "
    "at that moment has run to its end (successful or failed)",
    "recovery.beat_host_cut": "seconds from the cut until PostgreSQL shows the standby beat "
    "holding the leader lock (polled every 0.5 s during the cut)",
    "recovery.data_flap": "seconds from the flapping's end until every invoice pending at its "
    "start has its email (or a dead letter)",
    "sends_cut (partitions)": "messages the SMTP server accepted from the cut host in the 5 s "
    "before the cut or during it, less those the database had marked sent just after the cut "
    "(worker_host_cut) or by the heal (worker_db_cut): sends whose sender could not mark them",
    "hosts.zombie_sends": "for each worker host cut: the claims its worker held at the cut "
    "(state 'sending', owned by one of its pids), how many were taken over (a higher claim "
    "token at the end) and sent by the end, and the messages accepted from that host for "
    "them after its lease lapsed (the cut's start plus EMAIL_CLAIM_LEASE_SECONDS)",
    "hosts.beats": "from the beats' logs (INFO): each dispatch, and when a beat took the lock; "
    "a slot dispatched twice is two dispatches of one periodic task by different beats less "
    "than half its interval apart",
    "email_flow_resumed": "seconds from the end of a fault until the SMTP server next accepts "
    "a message",
    "webhook_2xx_resumed": "seconds from the end of a fault until a webhook next gets a 2xx "
    "(null once the load is over)",
    "tasks_terminated_by_their_worker_on_broker_loss": "task ids a worker terminated itself "
    "after losing its broker connection (Celery's worker_cancel_long_running_tasks_on_"
    "connection_loss), from the workers' logs: a send it cuts between the SMTP server's 250 "
    "and the database's mark is a duplicate nobody killed",
    "workers_stalled_with_work_waiting": "a worker that finished no task (success, retry or "
    "failure, from its log) while consecutive timeline samples showed emails waiting in the "
    "queue for more than 10 s (from/to: that stretch of samples)",
    "worker_failed_acks": "per worker, acknowledgements or rejections of a finished task's "
    'message that failed (Celery\'s "Couldn\'t ack" / "Couldn\'t reject"), from its log; each '
    "holds one of the worker's prefetch slots until its broker connection is re-established",
    "recovery_over_bound": "the worker kills, broker restarts and PostgreSQL restarts whose "
    "recovery took longer than recovery_bound_seconds (the profile's; null: no bound), or never "
    "came (seconds null): each misses the goal recovery_within_<bound>_s",
    "safety_net_actions": "from the workers' logs, what their poll did: the jobs the relay "
    "published (come due, or left unpublished past the grace period), the jobs each rescue "
    "gave back (jobs: running under a worker whose heartbeat lapsed or whose lease expired, "
    "and those a dead worker's consumer held), and how often a worker saw the broker lose its "
    "messages and how many jobs it published again then",
    "email_jobs_enqueued_beyond_the_first": "email jobs (rows) enqueued for an invoice beyond "
    "its first: a replay, or a second enqueue the webhook's idempotency should have prevented; "
    "a retry or a rescue runs the same job again",
    "unexpected_process_exits": "application processes that exited without being killed or "
    "stopped by the suite; workers and beat are started again a second later, as the "
    "deployment's process manager would",
    "times": "fault times are seconds from the start of the arm",
    "series": "one sample a second (seconds from the start of the arm): emails_waiting, paid "
    "invoices whose email is neither sent nor dead-lettered; email_queue, the email queues' "
    "depth on the broker (null: the broker did not answer)",
}


@dataclass(frozen=True)
class Inputs:
    arm: str
    profile: config.Profile
    seed: int
    started: float
    ended: float
    plan: Plan
    sender: Sender
    smtp: SmtpServer
    faults: list[dict[str, Any]]
    facts: Facts
    timeline: list[dict[str, Any]]
    quiescence: dict[str, Any]
    schedules: dict[str, Any]
    unexpected_exits: list[Exit]
    self_terminations: list[str]
    worker_outcomes: dict[str, list[float]]
    failed_acks: dict[str, int]
    log_dir: Path
    broker: str = "redis"
    hosts: dict[str, Any] | None = None  # across hosts: the topology, the beats, the zombies
    net_actions: NetActions | None = None
    without: tuple[str, ...] = ()  # the safety nets switched off (chaos.ablation)


def job_ids_of(records: list[dict[str, Any]]) -> list[int]:
    """The jobs a fault left unpublished, which the report follows up."""
    ids: list[int] = []
    for record in records:
        ids += record.get("left_unmarked", []) + record.get("unpublished_at_end", [])
    return ids


def _first_after(times: list[float], moment: float) -> float | None:
    later = [t for t in times if t >= moment]
    return round(min(later) - moment, 1) if later else None


def _seconds_until_all(done: list[float | None], moment: float) -> float | None:
    """Seconds from ``moment`` until the last of ``done`` (0 when there was nothing to wait
    for); None if any never happened."""
    if any(t is None for t in done):
        return None
    return round(max([0.0, *(t - moment for t in done if t is not None)]), 1)


def _seconds_until_share(done: list[float | None], moment: float, share: float) -> float | None:
    """Seconds from ``moment`` until ``share`` of ``done`` had happened (0 when at once)."""
    times = sorted(t for t in done if t is not None)
    needed = max(1, round(share * len(done)))
    if len(times) < needed:
        return None
    return round(max(0.0, times[needed - 1] - moment), 1)


def smtp_summary(smtp: SmtpServer) -> dict[str, Any]:
    """What the SMTP server did: its counts, and the faults it was given."""
    handler = smtp.handler
    with handler.lock:
        counts = dict(handler.counts)
        accepted = len(handler.envelopes)
    attempts = counts.get("data_attempts", 0)
    faults = handler.faults
    return {
        **counts,
        "accepted": accepted,
        "deferred_ratio": round(counts.get("deferred_451", 0) / attempts, 3) if attempts else 0,
        "faults": {
            "defer_rate": faults.defer_rate,
            "max_deferrals_per_message": faults.max_deferrals,
            "slow_rate": faults.delay_share,
            "slow_seconds": [faults.delay, faults.delay_max],
            "refused_domain": faults.refuse_domain,
        },
    }


class _Analysis:
    def __init__(self, inputs: Inputs) -> None:
        self.i = inputs
        facts = inputs.facts
        self.pk_of = {provider: pk for pk, (provider, _) in facts.invoices.items()}
        self.messages: dict[str, list[Received]] = defaultdict(list)
        self.endings: dict[int, str] = {}  # id() of an accepted message -> its session's end
        invoice_of = inputs.plan.invoice_of
        self.stray = 0
        with inputs.smtp.handler.lock:
            accepted = list(inputs.smtp.handler.envelopes)
            self.cuts = list(inputs.smtp.handler.cuts)
            endings = dict(inputs.smtp.handler.endings)
        for index, message in enumerate(accepted):
            self.endings[id(message)] = endings.get(index, "open")
            invoice = invoice_of.get(message.recipient)
            if invoice is None:
                self.stray += 1
            else:
                self.messages[invoice].append(message)
        self.accept_times = sorted(m.at for m in accepted)
        self.done_at: dict[int, float | None] = {}
        for pk in facts.invoices:
            delivery = facts.deliveries.get(pk)
            self.done_at[pk] = delivery["sent_at"] if delivery else None
        for letter in facts.dead_letters:
            pk = letter["invoice_pk"]
            if pk is not None and self.done_at.get(pk) is None:
                self.done_at[pk] = letter["created_at"]
        with inputs.sender.responses.lock:
            self.ok_times = sorted(
                t for t, status in inputs.sender.responses.log if 200 <= status < 300
            )

    def rel(self, moment: float) -> float:
        return round(moment - self.i.started, 1)

    def fault(self, record: dict[str, Any]) -> dict[str, Any]:
        kind = record["kind"]
        hidden = ("pending_invoices", "unpublished_at_end", "at", "ended")
        out = {k: v for k, v in record.items() if k not in hidden}
        if "skipped" in record:
            return out
        at, ended = record["at"], record["ended"]
        out["at"] = self.rel(at)
        out["ended"] = self.rel(ended)
        out["email_flow_resumed"] = _first_after(self.accept_times, ended)
        out["webhook_2xx_resumed"] = (
            _first_after(self.ok_times, ended) if record.get("during_load") else None
        )
        if kind == WORKER_KILL:
            invoice_of = self.i.plan.invoice_of
            pks = [
                self.pk_of.get(invoice_of.get(v["recipient"], ""))
                for v in record["sessions_in_data"]
            ]
            out["recovery_seconds"] = _seconds_until_all(
                [self.done_at.get(pk) if pk else None for pk in pks], at
            )
        elif kind == RELAY_KILL:
            finished = self.i.facts.finished_at
            out["done"] = sum(finished.get(pk) is not None for pk in record["left_unmarked"])
            out["recovery_seconds"] = _seconds_until_all(
                [finished.get(pk) for pk in record["left_unmarked"]], at
            )
        elif "takeover_seconds" in record:  # a beat host's cut: the standby leads
            out["recovery_seconds"] = record["takeover_seconds"]
        elif kind == BROKER_STALL or "unpublished_at_end" in record:
            rows = record["unpublished_at_end"]
            out["unpublished_rows_at_end"] = len(rows)
            out["recovery_seconds"] = _seconds_until_all(
                [self.i.facts.finished_at.get(pk) for pk in rows], ended
            )
        elif kind in (REDIS_RESTART, RABBITMQ_RESTART, POSTGRES_RESTART) or (
            "pending_invoices" in record
        ):
            pending = record.get("pending_invoices") or []
            done = [self.done_at.get(pk) for pk in pending]
            # A host's cut is survived by the other hosts: measured from its start.
            since = at if record.get("recovery_from") == "at" else ended
            out["pending_invoices_at_fault"] = len(pending)
            out["pending_never_done"] = sum(t is None for t in done)
            out["recovery_seconds"] = _seconds_until_all(done, since)
            out["half_done_seconds"] = _seconds_until_share(done, since, 0.5)
            out["nine_tenths_done_seconds"] = _seconds_until_share(done, since, 0.9)
            deliveries = self.i.facts.deliveries
            out["slowest"] = [
                {
                    "invoice_pk": pk,
                    "seconds": round(t - since, 1),
                    "claim_attempts": deliveries.get(pk, {}).get("attempts"),
                }
                for t, pk in sorted(
                    ((t, pk) for t, pk in zip(done, pending, strict=True) if t is not None),
                    reverse=True,
                )[:3]
            ]
        out["recovered"] = out.get("recovery_seconds") is not None
        return out


STALL_GAP = 10.0  # seconds without finishing a task, while emails wait, that make a stall


def over_bound(fault: dict[str, Any], bound: float | None) -> bool:
    """Whether ``fault`` is bounded, ran, and did not recover within ``bound`` seconds."""
    seconds = fault.get("recovery_seconds")
    return (
        bound is not None
        and fault["kind"] in BOUNDED_FAULTS
        and "skipped" not in fault
        and (seconds is None or seconds > bound)
    )


def recovery_over_bound(faults: list[dict[str, Any]], bound: float | None) -> list[dict[str, Any]]:
    """The bounded faults that did not recover within ``bound`` (``seconds`` None: never)."""
    return [
        {"kind": f["kind"], "at": f["at"], "seconds": f.get("recovery_seconds")}
        for f in faults
        if over_bound(f, bound)
    ]


def recovery_goal(bound: float) -> str:
    return f"recovery_within_{bound:g}_s"


def _waiting_stretch(timeline: list[dict[str, Any]], start: float, end: float) -> list[Any]:
    """The longest run of consecutive samples between ``start`` and ``end`` in which emails
    were waiting in the queue (a sample that could not measure it ends a run)."""
    best: list[Any] = []
    run: list[Any] = []
    for sample in timeline:
        if not start <= sample["at"] <= end:
            continue
        if sample["email_queue"]:
            run.append(sample)
            if run[-1]["at"] - run[0]["at"] > (best[-1]["at"] - best[0]["at"] if best else -1):
                best = list(run)
        else:
            run = []
    return best


def stalled_workers(inputs: Inputs, rel: Callable[[float], float]) -> list[dict[str, Any]]:
    """Workers that finished no task while emails waited in the queue for more than
    ``STALL_GAP`` seconds, between two of their task outcomes or up to their kill or the
    end of the run."""
    ends = {r["worker"]: r["at"] for r in inputs.faults if r["kind"] == WORKER_KILL and "at" in r}
    run_end = inputs.timeline[-1]["at"] if inputs.timeline else inputs.ended
    stalls = []
    for worker, times in inputs.worker_outcomes.items():
        if not times:
            continue
        for start, end in itertools.pairwise([*times, ends.get(worker, run_end)]):
            stretch = _waiting_stretch(inputs.timeline, start, end)
            if stretch and stretch[-1]["at"] - stretch[0]["at"] > STALL_GAP:
                stalls.append(
                    {
                        "worker": worker,
                        "from": rel(stretch[0]["at"]),
                        "to": rel(stretch[-1]["at"]),
                        "seconds": round(stretch[-1]["at"] - stretch[0]["at"], 1),
                        "email_queue_at_least": min(s["email_queue"] for s in stretch),
                    }
                )
    return stalls


def series(timeline: list[dict[str, Any]], rel: Callable[[float], float]) -> dict[str, list[Any]]:
    """The timeline, kept in the result file for its plot: see DEFINITIONS["series"]."""
    measured = [s for s in timeline if None not in (s["paid"], s["sent"], s["dead_letters"])]
    return {
        "seconds": [rel(s["at"]) for s in measured],
        "emails_waiting": [max(0, s["paid"] - s["sent"] - s["dead_letters"]) for s in measured],
        "email_queue": [s["email_queue"] for s in measured],
    }


def build(inputs: Inputs) -> dict[str, Any]:
    a = _Analysis(inputs)
    plan, facts, sender = inputs.plan, inputs.facts, inputs.sender
    responses = sender.responses
    paid_db = {provider for provider, status in facts.invoices.values() if status == "paid"}
    acked = set(responses.acked_invoices)
    paid = paid_db | acked
    acknowledged_not_stored = sorted(acked - paid_db)
    deliverable = paid - plan.refused
    delivered = set(a.messages)
    lost = sorted(deliverable - delivered) + acknowledged_not_stored

    message_id_db = {facts.invoices[pk][0]: d["message_id"] for pk, d in facts.deliveries.items()}
    marked_sent = {
        facts.invoices[pk][0] for pk, d in facts.deliveries.items() if d["state"] == "sent"
    }
    kills = [r for r in inputs.faults if r["kind"] == WORKER_KILL and "skipped" not in r]
    # A partition (chaos.hosts) cuts sends too: those accepted while the sender could not mark
    # them.
    cutting = [r for r in inputs.faults if "sends_cut" in r]
    cut_by_kills = {message_id for r in cutting for message_id in r["sends_cut"]}
    closed_by_kills = {message_id for r in kills for message_id in r["sessions_cut"]}
    duplicates: list[dict[str, Any]] = []
    for invoice, messages in sorted(a.messages.items()):
        if len(messages) > 1:
            ids = {m.message_id for m in messages}
            pk = a.pk_of.get(invoice, 0)
            duplicates.append(
                {
                    "invoice": invoice,
                    "invoice_pk": pk,
                    "messages": len(messages),
                    "accepted_at": [a.rel(m.at) for m in messages],
                    "sessions_ended": [a.endings[id(m)] for m in messages],
                    "claim_attempts": facts.deliveries.get(pk, {}).get("attempts"),
                    "message_ids": sorted(ids),
                    "same_message_id": len(ids) == 1 and ids == {message_id_db.get(invoice)},
                    "cut_by_a_kill": ids <= cut_by_kills,
                }
            )
    extra = sum(d["messages"] - 1 for d in duplicates)
    sends_cut = sum(r["sends_cut_in_window"] for r in cutting)

    letters: list[dict[str, Any]] = []
    for letter in facts.dead_letters:
        pk = letter["invoice_pk"]
        letter_invoice = facts.invoices[pk][0] if pk in facts.invoices else None
        permanent = (
            letter["reason"] == "permanent"
            and letter_invoice in plan.refused
            and "refused" in letter["exception"]
        )
        letters.append(
            {
                **letter,
                "invoice": letter_invoice,
                "permanent_refusal": permanent,
                "created_at": a.rel(letter["created_at"]),
            }
        )
    dead_lettered = {entry["invoice"] for entry in letters}
    refused_without_dead_letter = sorted((paid & plan.refused) - dead_lettered)

    relay_kills = [r for r in inputs.faults if r["kind"] == RELAY_KILL]
    faults = [a.fault(record) for record in inputs.faults]
    results: dict[str, Any] = {
        "invoices_paid": len(paid),
        "invoices_paid_deliverable": len(deliverable),
        "invoices_paid_refused_recipient": len(paid & plan.refused),
        "acknowledged_not_stored": acknowledged_not_stored,
        "emails_delivered": {"invoices": len(delivered), "messages": len(a.accept_times)},
        "messages_to_unknown_recipients": a.stray,
        "emails_marked_sent_in_db": len(marked_sent),
        "marked_sent_not_delivered": sorted(marked_sent - delivered),
        "delivered_not_marked_sent": len(delivered - marked_sent),
        "lost": len(lost),
        "lost_invoices": lost[:50],
        "duplicates": {
            "invoices": len(duplicates),
            "extra_messages": extra,
            "all_same_message_id": all(d["same_message_id"] for d in duplicates),
            "all_cut_by_a_kill": all(d["cut_by_a_kill"] for d in duplicates),
            "detail": duplicates,
        },
        "dead_letters": {
            "total": len(letters),
            "permanent_refusals": sum(e["permanent_refusal"] for e in letters),
            "all_permanent_refusals": all(e["permanent_refusal"] for e in letters),
            "refused_without_dead_letter": refused_without_dead_letter,
            "detail": [e for e in letters if not e["permanent_refusal"]][:50],
        },
        "kills": {
            "worker_kills": len(kills),
            "worker_kills_inside_crash_window": sum(r["in_crash_window"] for r in kills),
            "sends_cut_in_window_by_kills": sends_cut,
            "unattributed_cuts": [
                {"at": a.rel(at), "message_id": cut.message_id}
                for at, cut in a.cuts
                if cut.message_id not in closed_by_kills
            ],
            "tasks_terminated_by_their_worker_on_broker_loss": inputs.self_terminations,
            "relay_kills": sum(r["outcome"] == "killed" for r in relay_kills),
            "relay_kills_between_publish_and_mark": sum(r["landed"] for r in relay_kills),
            "relay_rows_published_unmarked": sum(len(r["left_unmarked"]) for r in relay_kills),
        },
        "every_fault_recovered": all(f.get("recovered", False) for f in faults),
        "recovery_bound_seconds": inputs.profile.recovery_bound,
        "recovery_over_bound": recovery_over_bound(faults, inputs.profile.recovery_bound),
        "workers_stalled_with_work_waiting": stalled_workers(inputs, a.rel),
        "worker_failed_acks": inputs.failed_acks,
        "unexpected_process_exits": [
            {**asdict(e), "at": a.rel(e.at)} for e in inputs.unexpected_exits
        ],
        "email_jobs_enqueued_beyond_the_first": sum(
            n - 1 for n in facts.email_jobs_per_invoice.values() if n > 1
        ),
        "safety_net_actions": asdict(inputs.net_actions) if inputs.net_actions else None,
    }
    if inputs.arm == config.SAFE:
        goals = {
            "lost_zero": not lost,
            "refused_recipients_dead_lettered": not refused_without_dead_letter,
            "dead_letters_all_permanent_refusals": results["dead_letters"][
                "all_permanent_refusals"
            ],
            "duplicates_within_sends_cut_by_kills": extra <= sends_cut,
            "duplicates_share_message_id": results["duplicates"]["all_same_message_id"],
            "nothing_marked_sent_undelivered": not results["marked_sent_not_delivered"],
            # A fault that was planned but did not land proves nothing: the run does not count.
            "relay_kills_landed": all(r["landed"] for r in relay_kills),
        }
        bound = inputs.profile.recovery_bound
        if bound is not None and any(f["kind"] in BOUNDED_FAULTS for f in faults):
            goals[recovery_goal(bound)] = not results["recovery_over_bound"]
        goals["no_worker_stalled_with_work_waiting"] = not results[
            "workers_stalled_with_work_waiting"
        ]
    else:
        goals = {"loss_observed": bool(lost)}
    if inputs.hosts is not None:
        results["hosts"] = inputs.hosts
        if inputs.arm == config.SAFE:
            goals.update(inputs.hosts.get("goals", {}))
    load = {
        **plan.describe(),
        "senders": sender.senders,
        "rate_per_second": sender.rate,
        "seconds": round(sender.ended - sender.started, 1),
        "responses_by_status": dict(sorted(responses.by_status.items())),
        "retries": responses.retries,
        "deliveries_never_acknowledged": len(responses.given_up),
    }
    profile = inputs.profile
    return {
        "arm": inputs.arm,
        "profile": profile.name,
        "broker": inputs.broker,
        "seed": inputs.seed,
        "started_at": utc(inputs.started),
        "duration_seconds": round(inputs.ended - inputs.started, 1),
        "passed": all(goals.values()),
        "goals": goals,
        "results": results,
        "load": load,
        "faults": faults,
        "series": series(inputs.timeline, a.rel),
        "smtp": smtp_summary(inputs.smtp),
        "quiescence": inputs.quiescence,
        "config": {
            "workers": profile.workers,
            "worker_concurrency": profile.concurrency,
            "worker_settings": config.worker_settings(inputs.arm),
            "worker_app": config.worker_app(inputs.arm),
            "gunicorn_workers": profile.web_workers,
            "timing_env": {
                **config.TIMING,
                **config.TIMING_ENV,
                "VISIBILITY_TIMEOUT": config.VISIBILITY_TIMEOUT,
            },
            "safety_nets_off": list(inputs.without),
            "periodic_tasks": inputs.schedules,
            "fault_plan": [
                {"at_share_of_load": s.at, "kind": s.kind, "window": s.window, "seconds": s.seconds}
                for s in profile.steps
            ],
        },
        "scheduled_jobs": facts.jobs,
        "logs": str(inputs.log_dir),
        "definitions": DEFINITIONS,
        "timeline": [{**s, "at": a.rel(s["at"])} for s in inputs.timeline],
    }


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def summary(report: dict[str, Any]) -> str:
    r, load, kills = report["results"], report["load"], report["results"]["kills"]
    dup, letters = r["duplicates"], r["dead_letters"]
    cfg = report["config"]
    lines = [
        f"== chaos, {report['arm']} arm ({report['profile']} profile, seed {report['seed']}): "
        f"{cfg['workers']} workers x {cfg['worker_concurrency']} ({cfg['worker_settings']}), "
        f"{report['duration_seconds']} s"
        + (
            f"; safety nets off: {', '.join(cfg['safety_nets_off'])}"
            if cfg["safety_nets_off"]
            else ""
        ),
        f"load: {load['deliveries']} deliveries of {load['unique_events']} events for "
        f"{load['invoices']} invoices ({load['duplicate_share']:.0%} duplicates, "
        f"{load['invoices_with_both_event_types']} invoices with both event types) from "
        f"{load['senders']} senders in {load['seconds']} s; {load['retries']} retries, "
        f"{load['deliveries_never_acknowledged']} never acknowledged",
        "webhook responses: "
        + ", ".join(f"{status} x {n}" for status, n in load["responses_by_status"].items()),
        f"invoices paid: {r['invoices_paid']} ({r['invoices_paid_refused_recipient']} with a "
        f"refused recipient); acknowledged but not stored: {len(r['acknowledged_not_stored'])}",
        f"emails delivered: {r['emails_delivered']['invoices']} invoices / "
        f"{r['emails_delivered']['messages']} messages; marked sent in the database: "
        f"{r['emails_marked_sent_in_db']}",
        f"LOST: {r['lost']}",
        f"duplicates: {dup['invoices']} invoices, {dup['extra_messages']} extra messages; "
        f"same Message-ID: {_mark(dup['all_same_message_id'])}; all cut by a kill: "
        f"{_mark(dup['all_cut_by_a_kill'])}",
        f"kills: {kills['worker_kills']} worker kills, "
        f"{kills['worker_kills_inside_crash_window']} inside the crash window "
        f"({kills['sends_cut_in_window_by_kills']} sends cut); "
        f"{len(kills['unattributed_cuts'])} sends cut in the window by something else; "
        f"{len(kills['tasks_terminated_by_their_worker_on_broker_loss'])} tasks terminated by "
        "their own worker on broker loss; "
        f"{kills['relay_kills']} relay kills, {kills['relay_kills_between_publish_and_mark']} "
        f"between publish and mark ({kills['relay_rows_published_unmarked']} rows)",
        f"dead letters: {letters['total']}, permanent refusals {letters['permanent_refusals']}; "
        f"all permanent refusals: {_mark(letters['all_permanent_refusals'])}; refused "
        f"recipients without one: {len(letters['refused_without_dead_letter'])}",
        f"email jobs enqueued beyond the first: "
        f"{r['email_jobs_enqueued_beyond_the_first']}; processes that died by themselves: "
        + (
            ", ".join(
                f"{e['process']} (exit {e['exit_code']})" for e in r["unexpected_process_exits"]
            )
            or "none"
        ),
        "workers stalled with emails waiting: "
        + (
            ", ".join(
                f"{s['worker']} {s['seconds']} s (+{s['from']} to +{s['to']})"
                for s in r["workers_stalled_with_work_waiting"]
            )
            or "none"
        )
        + "; failed acks: "
        + (", ".join(f"{w} {n}" for w, n in r["worker_failed_acks"].items()) or "none"),
        f"safety nets acted: {net_actions_text(r['safety_net_actions'])}",
        "faults (seconds from the start; recovery as defined in the JSON); every one "
        f"recovered: {_mark(r['every_fault_recovered'])}",
    ]
    for fault in report["faults"]:
        if "skipped" in fault:
            lines.append(f"  {fault['kind']}: skipped ({fault['skipped']})")
            continue
        detail = {
            WORKER_KILL: lambda f: (
                f"{f['window']}, {f['worker']}, "
                f"{f['sends_cut_in_window']} send(s) cut in the window"
            ),
            RELAY_KILL: lambda f: (
                f"{f['outcome']}, {len(f['left_unmarked'])} rows left "
                f"unmarked, {f.get('done', 0)} of them run"
            ),
            BROKER_STALL: lambda f: (
                f"{f['seconds']} s, {f['unpublished_rows_at_end']} rows unpublished at its end"
            ),
            REDIS_RESTART: lambda f: (
                f"{f['queued_messages_dropped']} queued + "
                f"{f['unacked_messages_dropped']} unacked messages dropped, "
                f"{f['pending_invoices_at_fault']} invoices pending"
            ),
            RABBITMQ_RESTART: lambda f: (
                f"{f['queued_messages_before']} messages ready before, "
                f"{f['queued_messages_after']} after, "
                f"{f['pending_invoices_at_fault']} invoices pending"
            ),
            POSTGRES_RESTART: lambda f: f"{f['pending_invoices_at_fault']} invoices pending",
        }.get(fault["kind"], _partition_detail)(fault)
        recovery = fault.get("recovery_seconds")
        bound = r["recovery_bound_seconds"]
        over = recovery is not None and over_bound(fault, bound)
        lines.append(
            f"  +{fault['at']:>6} s {fault['kind']} ({detail}): "
            + (f"recovered in {recovery} s" if recovery is not None else "NOT RECOVERED")
            + (f" (OVER {bound:g} s)" if over else "")
            + "; emails flowing again "
            + (
                f"after {fault['email_flow_resumed']} s"
                if fault["email_flow_resumed"] is not None
                else "NEVER"
            )
        )
    lines.append(
        f"quiescence: {report['quiescence']['reason']} after {report['quiescence']['seconds']} s"
    )
    goals = ", ".join(f"{name} {_mark(ok)}" for name, ok in report["goals"].items())
    lines.append(f"goals: {goals} => {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


def net_actions_text(actions: dict[str, Any] | None) -> str:
    """What the safety nets did, in one line (``safety_net_actions``)."""
    if actions is None:
        return "not read"
    rescued = ", ".join(f"{name} {n}" for name, n in actions["rescued"].items()) or "nothing"
    return (
        f"relay published {actions['relayed']} job(s); rescue gave back {rescued}; "
        f"the broker lost its messages {actions['broker_losses']} time(s) as workers saw it, "
        f"{actions['republished']} job(s) published again"
    )


def _partition_detail(fault: dict[str, Any]) -> str:
    """A partition's line (chaos.hosts): the host, and what it left to recover."""
    parts = [fault.get("host", "?")]
    if "sends_cut" in fault:
        parts.append(f"{len(fault['sends_cut'])} send(s) cut")
    if "pending_invoices_at_fault" in fault:
        parts.append(f"{fault['pending_invoices_at_fault']} invoices pending")
    if "unpublished_rows_at_end" in fault:
        parts.append(f"{fault['unpublished_rows_at_end']} rows unpublished at the heal")
    if "cuts" in fault:
        parts.append(f"{fault['cuts']} cuts")
    return ", ".join(parts)


def utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def write(report: dict[str, Any], results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{report['arm']}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    (results_dir / f"{report['arm']}.txt").write_text(summary(report) + "\n")
    return path


def profile_write(
    reports: list[dict[str, Any]],
    results_dir: Path,
    *,
    profile: str,
    started: float,
    broker: str = "redis",
) -> Path:
    """The run's result file, ``<profile>.json`` (``<profile>-rabbitmq.json`` with RabbitMQ
    as the broker): when, on which machine, and each arm's report without its timeline (in
    ``<arm>.json``), from which the docs' table is generated."""
    name = profile if broker == "redis" else f"{profile}-{broker}"
    document = {
        "profile": name,
        "broker": broker,
        "started_at": utc(started),
        "finished_at": utc(time.time()),
        "revision": revision(),
        # The servers are stopped: their binaries' versions.
        "machine": describe(rabbitmq=broker == "rabbitmq"),
        "arms": {
            report["arm"]: {k: v for k, v in report.items() if k not in ("timeline", "logs")}
            for report in reports
        },
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path
