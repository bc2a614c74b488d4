"""Rescue by heartbeat, with real processes: two workers and the kit's SMTP server, on the
default leases (the job's: its hard time limit and a margin; the email claim's: 90 s) and
visibility timeout (180 s), so that anything recovered within seconds was recovered by the
heartbeat. No beat: each worker's poll runs the rescue. The heartbeat is scaled down (every
0.5 s, lapse 3 s).

* a worker SIGKILLed inside its SMTP conversation: the other worker's rescue gives its job
  back, and the job's next run takes the email's claim over and sends it within seconds, with
  at most one duplicate carrying the same Message-ID;
* a worker stopped (SIGSTOP) inside its SMTP conversation past the lapse, then resumed (a
  zombie): its job and claim were taken over meanwhile, it sends nothing more and its late
  writes change neither;
* a worker alive but slow (SMTP answering after longer than the lapse): never overtaken, by
  the rescue, by its job's message delivered again, nor by a second job for the same invoice.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from asyncwork.models import Job, WorkerHeartbeat
from invoicing.models import EmailDelivery
from invoicing.tasks import EMAIL_QUEUE, send_invoice_email
from stack import launch
from stack.net import wait_until
from stack.process import Process
from stack.smtp import IN_WINDOW, SmtpServer
from tests.helpers import broker
from tests.helpers.factories import paid_invoice
from tests.helpers.processes import asyncwork_changed, worker_env
from tests.helpers.quiescence import pipeline_quiet

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

GOAL_SECONDS = 30  # the goal: a killed worker's email sent by another within 30 s of the kill
LAPSE = 3
HEARTBEAT = asyncwork_changed(WORKER_HEARTBEAT_SECONDS=0.5, WORKER_HEARTBEAT_LAPSE_SECONDS=LAPSE)
RESCUED = "rescue jobs: 1 job(s) of worker processes that are gone released and re-enqueued"


def started(smtp: SmtpServer, *names: str, concurrency: int = 1) -> list[Process]:
    env = worker_env(smtp.port, HEARTBEAT)
    workers = [launch.celery_worker(env, name=name, concurrency=concurrency) for name in names]
    for worker in workers:
        worker.wait_ready()
    return workers


def holding(workers: list[Process], delivery: EmailDelivery) -> Process:
    """The worker whose pool process owns the claim (its owner is ``host:pid:token``)."""
    pid = int(delivery.claimed_by.split(":")[1])
    [worker] = [w for w in workers if pid in w.pids()]
    return worker


def row(model: Any, pk: int) -> dict[str, Any]:
    return dict(model.objects.values().get(pk=pk))


def test_a_worker_killed_mid_smtp_is_rescued_within_seconds(smtp: SmtpServer) -> None:
    invoice = paid_invoice("in_killed")
    workers = started(smtp, "killed-a", "killed-b")
    try:
        hold = smtp.handler.hold_next(IN_WINDOW, seconds=60)  # committed, 250 not yet sent
        job_id = int(send_invoice_email.enqueue(invoice.pk).id)
        assert hold.reached.wait(20)
        doomed = holding(workers, EmailDelivery.objects.get())
        doomed.kill()  # the whole worker, parent included
        killed = time.monotonic()
        sent = wait_until(
            lambda: EmailDelivery.objects.get().state == "sent", GOAL_SECONDS + 30, interval=0.1
        )
        seconds = time.monotonic() - killed
        [survivor] = [w for w in workers if w is not doomed]
        sent_by_survivor = holding(workers, EmailDelivery.objects.get()) is survivor
        assert wait_until(lambda: Job.objects.get(pk=job_id).status == "SUCCESSFUL", 10)
        logs = survivor.log_text()
        print(f"\nworker SIGKILLed mid-SMTP: the email marked sent {seconds:.1f} s later")
    finally:
        for process in workers:
            process.stop()
    assert sent, logs[-3000:]
    assert seconds <= GOAL_SECONDS
    delivery = EmailDelivery.objects.get()
    assert delivery.attempts == 2
    assert sent_by_survivor
    assert RESCUED in logs
    job = Job.objects.get(pk=job_id)
    assert job.attempts == 2  # the killed run counts
    # Run by the killed worker's process, then by the survivor's, which took the claim over.
    assert len(job.worker_ids) == 2
    assert job.worker_ids[1] == delivery.claimed_by != job.worker_ids[0]
    messages = smtp.messages
    assert len(messages) == 2  # the killed send was committed: the one duplicate
    assert {m["Message-ID"] for m in messages} == {delivery.message_id}


def test_a_zombie_sends_nothing_more_and_its_late_writes_change_nothing(
    smtp: SmtpServer,
) -> None:
    invoice = paid_invoice("in_zombie")
    workers = started(smtp, "zombie-a", "zombie-b")
    try:
        hold = smtp.handler.hold_next(IN_WINDOW, seconds=10)
        job_id = int(send_invoice_email.enqueue(invoice.pk).id)
        assert hold.reached.wait(20)
        delivery_id = EmailDelivery.objects.get().pk
        zombie = holding(workers, EmailDelivery.objects.get())
        zombie.signal_group(signal.SIGSTOP)  # the heartbeat stops with it
        stopped = time.monotonic()
        taken_over = wait_until(
            lambda: EmailDelivery.objects.get().state == "sent", GOAL_SECONDS, interval=0.1
        )
        seconds = time.monotonic() - stopped
        assert wait_until(lambda: Job.objects.get(pk=job_id).status == "SUCCESSFUL", 10)
        after_takeover = row(EmailDelivery, delivery_id)
        job_after_takeover = row(Job, job_id)
        # Resumed after the server has answered its held DATA: it reads the 250 and goes on.
        time.sleep(max(0.0, 11 - (time.monotonic() - stopped)))
        zombie.signal_group(signal.SIGCONT)
        finished = wait_until(
            lambda: (
                "taken over meanwhile" in zombie.log_text()
                and f"job {job_id}: its success not recorded" in zombie.log_text()
            ),
            20,
        )
        pipeline_quiet()  # anything more it would send or write
        zombie_log = zombie.log_text()
    finally:
        for process in workers:
            process.signal_group(signal.SIGCONT)
            process.stop()
    print(
        f"\nworker stopped mid-SMTP: its claim taken over and the email sent {seconds:.1f} s later"
    )
    assert taken_over
    assert after_takeover["attempts"] == 2
    assert job_after_takeover["attempts"] == 2
    assert finished, zombie_log[-3000:]
    # Its mark sent and its job's outcome, fenced on claims it no longer held, changed nothing.
    assert row(EmailDelivery, delivery_id) == after_takeover
    assert row(Job, job_id) == job_after_takeover
    messages = smtp.messages
    assert len(messages) == 2  # its own (committed before the stop) and the rescuer's
    assert {m["Message-ID"] for m in messages} == {after_takeover["message_id"]}
    assert smtp.handler.attempts == 2  # no DATA from the zombie after it came back


def test_a_slow_but_alive_worker_is_never_overtaken(smtp: SmtpServer) -> None:
    invoice = paid_invoice("in_slow")
    smtp.handler.faults.delay = 3 * LAPSE  # every DATA answered after three lapses
    [worker] = started(smtp, "slow-a", concurrency=2)  # a free slot for what comes again
    try:
        first = int(send_invoice_email.enqueue(invoice.pk).id)
        assert wait_until(lambda: smtp.handler.attempts == 1, 20, interval=0.1)
        # A heartbeat row dead for two hours: the poll's rescue deletes it, so its going shows
        # the rescue ran while the email was being sent (and found nothing to take over).
        WorkerHeartbeat.objects.create(
            owner="long-dead",
            hostname="h",
            pid=1,
            started_at=timezone.now() - timedelta(hours=3),
            beat_at=timezone.now() - timedelta(hours=2),
        )
        assert wait_until(
            lambda: not WorkerHeartbeat.objects.filter(owner="long-dead").exists(), 10
        )
        rescue_ran_while_sending = EmailDelivery.objects.get().state == "sending"
        # Once the claims are older than the lapse: the job's message delivered again (as a
        # broker's redelivery brings it), then a second job for the invoice (as a second
        # payment event would enqueue). Each finds its claim's owner beating.
        time.sleep(LAPSE + 1)
        broker.job_message_again(first, queue=EMAIL_QUEUE, shadow="redelivery")
        redelivery_skipped = wait_until(
            lambda: "redelivery[job-" in worker.log_text() and "'skipped'" in worker.log_text(),
            10,
            interval=0.1,
        )
        skipped_while_sending = EmailDelivery.objects.get().state == "sending"
        second = int(send_invoice_email.enqueue(invoice.pk).id)
        claim_waited = wait_until(
            lambda: "is claimed by another run" in worker.log_text(), 10, interval=0.1
        )
        claim_waited_while_sending = EmailDelivery.objects.get().state == "sending"
        sent = wait_until(lambda: EmailDelivery.objects.get().state == "sent", 30, interval=0.1)
        # The second job, deferred while the claim was held, looks again and finds it sent.
        second_done = wait_until(
            lambda: Job.objects.get(pk=second).status == "SUCCESSFUL", 30, interval=0.1
        )
        pipeline_quiet()
        log = worker.log_text()
    finally:
        smtp.handler.faults.delay = 0
        worker.stop()
    assert sent, log[-3000:]
    assert rescue_ran_while_sending
    assert redelivery_skipped, log[-3000:]
    assert skipped_while_sending
    assert claim_waited, log[-3000:]
    assert claim_waited_while_sending
    assert second_done, log[-3000:]
    delivery = EmailDelivery.objects.get()
    assert delivery.attempts == 1  # claimed once: nobody took it over
    assert len(smtp.messages) == 1
    assert "rescue jobs" not in log
    done = {job.pk: job for job in Job.objects.all()}
    assert (done[first].status, done[first].attempts) == ("SUCCESSFUL", 1)
    assert done[first].return_value == "sent"
    assert (done[second].status, done[second].return_value) == ("SUCCESSFUL", "skipped")
    assert done[second].attempts == 1  # waiting spent none
