"""Rescue by heartbeat, with real processes: two workers, beat and the kit's SMTP server, on the
default lease (90 s) and visibility timeout (180 s), so that anything recovered within seconds
was recovered by the heartbeat. The heartbeat is scaled down (every 0.5 s, lapse 3 s).

* a worker SIGKILLed inside its SMTP conversation: the other worker sends the email within
  seconds, with at most one duplicate carrying the same Message-ID;
* a worker stopped (SIGSTOP) inside its SMTP conversation past the lapse, then resumed (a
  zombie): its claim was taken over meanwhile, it sends nothing more and its late writes
  change nothing;
* a worker alive but slow (SMTP answering after longer than the lapse): never overtaken.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from invoicing.models import EmailDelivery
from invoicing.tasks import send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.process import Process
from stack.smtp import IN_WINDOW, SmtpServer
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import worker_env
from tests.helpers.quiescence import pipeline_quiet

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

GOAL_SECONDS = 30  # the goal: a killed worker's email sent by another within 30 s of the kill
LAPSE = 3
HEARTBEAT = {"WORKER_HEARTBEAT_SECONDS": 0.5, "WORKER_HEARTBEAT_LAPSE_SECONDS": LAPSE}


def started(smtp: SmtpServer, *names: str, concurrency: int = 1) -> tuple[Process, list[Process]]:
    env = worker_env(smtp.port, HEARTBEAT)
    beat = launch.celery_beat(env, name=f"{names[0]}-beat")
    workers = [launch.celery_worker(env, name=name, concurrency=concurrency) for name in names]
    beat.wait_ready()
    for worker in workers:
        worker.wait_ready()
    return beat, workers


def holding(workers: list[Process], delivery: EmailDelivery) -> Process:
    """The worker whose pool process owns the claim (its owner is ``host:pid:token``)."""
    pid = int(delivery.claimed_by.split(":")[1])
    [worker] = [w for w in workers if pid in w.pids()]
    return worker


def row(delivery: EmailDelivery) -> dict[str, Any]:
    return dict(EmailDelivery.objects.values().get(pk=delivery.pk))


def test_a_worker_killed_mid_smtp_is_rescued_within_seconds(smtp: SmtpServer) -> None:
    invoice = paid_invoice("in_killed")
    beat, workers = started(smtp, "killed-a", "killed-b")
    try:
        hold = smtp.handler.hold_next(IN_WINDOW, seconds=60)  # committed, 250 not yet sent
        send_invoice_email.delay(invoice.pk)
        assert hold.reached.wait(20)
        doomed = holding(workers, EmailDelivery.objects.get())
        doomed.kill()  # the whole worker, parent included
        killed = time.monotonic()
        sent = wait_until(
            lambda: EmailDelivery.objects.get().state == "sent", GOAL_SECONDS + 30, interval=0.1
        )
        seconds = time.monotonic() - killed
        [survivor] = [w for w in workers if w is not doomed]
        logs = survivor.log_text()
        sent_by_survivor = holding(workers, EmailDelivery.objects.get()) is survivor
        print(f"\nworker SIGKILLed mid-SMTP: the email marked sent {seconds:.1f} s later")
    finally:
        for process in (*workers, beat):
            process.stop()
    assert sent, logs[-3000:]
    assert seconds <= GOAL_SECONDS
    delivery = EmailDelivery.objects.get()
    assert delivery.attempts == 2
    assert sent_by_survivor
    assert "rescue email-claims: 1 claim(s)" in logs
    messages = smtp.messages
    assert len(messages) == 2  # the killed send was committed: the one duplicate
    assert {m["Message-ID"] for m in messages} == {delivery.message_id}


def test_a_zombie_sends_nothing_more_and_its_late_writes_change_nothing(
    smtp: SmtpServer,
) -> None:
    invoice = paid_invoice("in_zombie")
    beat, workers = started(smtp, "zombie-a", "zombie-b")
    try:
        hold = smtp.handler.hold_next(IN_WINDOW, seconds=10)
        send_invoice_email.delay(invoice.pk)
        assert hold.reached.wait(20)
        zombie = holding(workers, EmailDelivery.objects.get())
        zombie.signal_group(signal.SIGSTOP)  # the heartbeat stops with it
        stopped = time.monotonic()
        taken_over = wait_until(
            lambda: EmailDelivery.objects.get().state == "sent", GOAL_SECONDS, interval=0.1
        )
        seconds = time.monotonic() - stopped
        after_takeover = row(EmailDelivery.objects.get())
        # Resumed after the server has answered its held DATA: it reads the 250 and goes on.
        time.sleep(max(0.0, 11 - (time.monotonic() - stopped)))
        zombie.signal_group(signal.SIGCONT)
        finished = wait_until(
            lambda: (
                "taken over meanwhile" in zombie.log_text()
                and " succeeded in " in zombie.log_text()
            ),
            20,
        )
        pipeline_quiet()  # anything more it would send or write
        zombie_log = zombie.log_text()
    finally:
        for process in (*workers, beat):
            process.signal_group(signal.SIGCONT)
            process.stop()
    print(
        f"\nworker stopped mid-SMTP: its claim taken over and the email sent {seconds:.1f} s later"
    )
    assert taken_over
    assert after_takeover["attempts"] == 2
    assert finished, zombie_log[-3000:]
    assert row(EmailDelivery.objects.get()) == after_takeover  # its mark sent changed nothing
    messages = smtp.messages
    assert len(messages) == 2  # its own (committed before the stop) and the rescuer's
    assert {m["Message-ID"] for m in messages} == {after_takeover["message_id"]}
    assert smtp.handler.attempts == 2  # no DATA from the zombie after it came back


def test_a_slow_but_alive_worker_is_never_overtaken(smtp: SmtpServer) -> None:
    invoice = paid_invoice("in_slow")
    smtp.handler.faults.delay = 3 * LAPSE  # every DATA answered after three lapses
    beat, [worker] = started(smtp, "slow-a", concurrency=2)  # a free slot for the second
    try:
        send_invoice_email.delay(invoice.pk)
        assert wait_until(lambda: smtp.handler.attempts == 1, 20, interval=0.1)
        # The same job again, as a redelivery would bring it, once the claim is older than
        # the lapse; meanwhile the rescue job runs (every 2 s) and finds the owner beating.
        send_invoice_email.apply_async(args=(invoice.pk,), countdown=LAPSE + 1)
        sent = wait_until(lambda: EmailDelivery.objects.get().state == "sent", 30, interval=0.1)
        skipped = wait_until(
            lambda: "already sent or in progress" in worker.log_text(), 20, interval=0.1
        )
        log = worker.log_text()
    finally:
        smtp.handler.faults.delay = 0
        worker.stop()
        beat.stop()
    assert sent, log[-3000:]
    assert skipped, log[-3000:]
    delivery = EmailDelivery.objects.get()
    assert delivery.attempts == 1  # claimed once: nobody took it over
    assert len(smtp.messages) == 1
    assert "rescue email-claims" not in log
    assert "job workers-rescue ran" in log  # the rescue did run while it was sending
