"""The dead-letter queue: recorded once, as a row, listed, replayed once (from the command
and the admin), purged, and alerted on."""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from asyncwork.audit import cli_actor
from asyncwork.broker import DLQ
from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.periodic.alert import dlq_alert
from asyncwork.deadletters import purge, record
from asyncwork.errors import PermanentError
from asyncwork.models import DeadLetter, Job
from invoicing.models import Invoice
from invoicing.services import invoice_recipient_correct
from invoicing.tasks import invoice_email_send, send_invoice_email
from stack import launch, stripe_events
from stack.net import wait_until
from stack.smtp import SmtpServer
from tests import tasks as test_tasks
from tests.helpers import broker
from tests.helpers.admin import messages as changelist_messages
from tests.helpers.admin import rows
from tests.helpers.deadletters import refused_invoice_dead_letter
from tests.helpers.factories import paid_invoice, staff_user
from tests.helpers.processes import python, worker_env, worker_thread
from tests.helpers.quiescence import pipeline_quiet
from tests.helpers.stripe import paid_event, post_event

pytestmark = pytest.mark.django_db(transaction=True)


def dlq(*args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command("dlq", *args, stdout=out)
    return out.getvalue()


def test_replay_after_the_recipient_is_fixed_sends_one_email_and_twice_is_once(
    client: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)
        listed = json.loads(dlq("list", "--json"))
        assert [x["id"] for x in listed] == [letter.pk]
        assert {"id", "task", "args", "reason", "attempts", "created_at", "replayed_at"} <= set(
            listed[0]
        )
        assert (listed[0]["args"], listed[0]["replayed_at"]) == ([invoice.pk], None)

        Invoice.objects.filter(pk=invoice.pk).update(customer_email="fixed@example.com")
        assert "1 replayed, 0 skipped" in dlq("replay", str(letter.pk))
        smtp.handler.wait_for(1, timeout=20)
        assert "0 replayed, 1 skipped" in dlq("replay", str(letter.pk))
        assert "0 replayed, 0 skipped" in dlq("replay", "--all")
        pipeline_quiet()
    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <fixed@example.com>"]
    letter.refresh_from_db()
    assert letter.replayed_at is not None
    assert letter.replayed_by == cli_actor()
    # Each replay asked for is recorded, under the OS user, by the one service.
    recorded = OperatorAction.objects.order_by("pk")
    assert [(a.actor, a.target, a.detail.split(":")[0]) for a in recorded] == [
        (cli_actor(), letter, "replayed"),
        (cli_actor(), letter, "skipped"),
    ]
    assert json.loads(dlq("list", "--json"))[0]["replayed_at"] is not None


def test_replay_of_a_dead_letter_whose_email_was_meanwhile_sent_sends_nothing(
    client: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        invoice, _letter = refused_invoice_dead_letter(client, smtp)
        smtp.handler.faults.refuse = set()
        assert invoice_email_send(invoice_id=invoice.pk, owner="operator") == "sent"
        # Its address is the one that failed: the replay check refuses it, so it is forced.
        dlq("replay", "--all", "--force")
        pipeline_quiet()
    assert len(smtp.messages) == 1


def test_replay_from_the_admin_action(client: Client, smtp: SmtpServer) -> None:
    admin = get_user_model().objects.create_superuser("op", "op@example.com", "pw-12345-long")
    with worker_thread():
        _invoice, letter = refused_invoice_dead_letter(client, smtp)
        smtp.handler.faults.refuse = set()
        staff = Client()
        staff.force_login(admin)
        page = staff.get(f"/admin/asyncwork/deadletter/{letter.pk}/change/")
        assert page.status_code == 200
        assert b"Traceback" in page.content
        chosen = {"action": "replay_selected", "_selected_action": [letter.pk]}
        asked = staff.post("/admin/asyncwork/deadletter/", chosen, follow=True)
        assert b"Replay <strong>1</strong> dead letter:" in asked.content
        # The address is unchanged, so the replay check refuses it: the mailbox was fixed at
        # the provider's end, and the operator replays it anyway.
        assert b'<ul id="refused">' in asked.content
        confirmed = {**chosen, "force": "1"}
        response = staff.post("/admin/asyncwork/deadletter/", confirmed, follow=True)
        assert b"Replayed 1 dead letter(s)." in response.content
        response = staff.post("/admin/asyncwork/deadletter/", confirmed, follow=True)
        assert b"Replayed 0 dead letter(s)." in response.content
        assert b"Skipped 1 already replayed." in response.content
        pipeline_quiet()
    assert len(smtp.messages) == 1
    letter.refresh_from_db()
    assert letter.replayed_by == "admin:op"


def test_unknown_id_is_a_clear_error_with_non_zero_exit() -> None:
    with pytest.raises(CommandError, match="no dead letter with id 424242"):
        dlq("replay", "424242")
    result = python("manage.py", "dlq", "replay", "424242")
    assert result.returncode == 1
    assert "no dead letter with id 424242" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(CommandError, match="not both"):
        dlq("replay", "1", "--all")


def recorded(task_id: str = "t-1", **extra: Any) -> DeadLetter | None:
    return record(
        task=send_invoice_email.module_path,
        task_id=task_id,
        args=[1],
        kwargs={"key": "k-1"},
        queue="email",
        reason="permanent",
        exc=PermanentError("nope"),
        traceback="tb",
        attempts=1,
        **extra,
    )


def test_recording_the_same_task_twice_keeps_one_dead_letter_and_nothing_else() -> None:
    first = recorded()
    second = recorded()  # the worker died after recording and ran the job again
    assert first is not None
    assert second is None
    letter = DeadLetter.objects.get()
    # The job's own arguments, as its replay calls it again.
    assert (letter.args, letter.kwargs) == ([1], {"key": "k-1"})
    # The row is the one record: no job for the broker, no queue holding a copy.
    assert not Job.objects.exists()
    assert broker.queue_depth(DLQ) == 0


def test_purge_older_than_days_is_recorded_per_dead_letter() -> None:
    old = recorded("old")
    recorded("new")
    assert old is not None
    DeadLetter.objects.filter(task_id="old").update(created_at=timezone.now() - timedelta(days=40))
    assert "purged 1 dead letter(s)" in dlq("purge", "--older-than", "30", "--actor", "ops-ann")
    assert list(DeadLetter.objects.values_list("task_id", flat=True)) == ["new"]
    [purged] = OperatorAction.objects.all()
    assert (purged.action, purged.actor, purged.target_id) == (
        "dead_letter.purge",
        "cli:ops-ann",
        str(old.pk),
    )
    # The row is gone; what it was stays readable in the trail.
    assert purged.target_label == str(old)
    assert purged.detail == "purged: older than 30 day(s), never replayed"
    with pytest.raises(CommandError):
        dlq("purge", "--older-than", "-1")


def test_a_purge_that_cannot_be_recorded_deletes_nothing() -> None:
    recorded("old")
    DeadLetter.objects.update(created_at=timezone.now() - timedelta(days=40))
    with pytest.raises(ValueError, match="needs an actor"):
        purge(older_than=timedelta(days=30), actor="")
    assert DeadLetter.objects.count() == 1
    assert not OperatorAction.objects.exists()


def test_dlq_alert_logs_and_mails_once_per_period(
    caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.ASYNCWORK = {**settings.ASYNCWORK, "DLQ_ALERT_THRESHOLD": 2}
    cache.delete("dlq-alert-sent")
    recorded("a")
    with caplog.at_level(logging.ERROR, logger="asyncwork.contrib.periodic.alert"):
        assert dlq_alert() == 1  # below the threshold
        recorded("b")
        assert dlq_alert() == 2
        assert dlq_alert() == 2  # within the period: no second alert
    alerts = [r for r in caplog.records if "alert threshold" in r.getMessage()]
    assert len(alerts) == 1
    assert [m.subject for m in mail.outbox] == ["[Django] Dead-letter queue depth 2"]
    assert "went through EMAIL_BACKEND django.core.mail.backends.locmem" in mail.outbox[0].body
    cache.delete("dlq-alert-sent")


# A record of the text format ("%(asctime)s %(levelname)s %(name)s %(message)s"); the lines
# after it that do not start like one (a traceback) belong to it.
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ([A-Z]+) (\S+) (.*)$")


def log_records(output: str) -> list[tuple[str, str, str]]:
    """(level, logger, the record's text including any traceback) for each record."""
    records: list[tuple[str, str, str]] = []
    for line in output.splitlines():
        match = RECORD.match(line)
        if match:
            records.append((match[1], match[2], match[3]))
        elif records:
            level, name, text = records[-1]
            records[-1] = (level, name, f"{text}\n{line}")
    return records


@pytest.mark.slow
def test_each_dead_letter_is_one_error_line_and_only_a_bug_logs_its_traceback(
    client: Client, smtp: SmtpServer
) -> None:
    """A real worker process dead-letters a refused recipient (permanent), a mail server that
    answers 451 to all five attempts (exhausted) and a bug (ZeroDivisionError): one ERROR
    line each, naming the dead letter, the task, its id, its args and the reason. Expected
    failures log no traceback (it is on the row); the bug's line carries its traceback."""
    smtp.handler.faults.refuse = {"typo@exmaple.com"}
    worker = launch.celery_worker(
        # The breaker stays out of it: five transient failures would open it otherwise.
        worker_env(smtp.port, EMAIL_BREAKER_FAILURE_THRESHOLD="100"),
        name="dead-letter-logs",
        include=("tests.tasks",),
    )

    def failed(count: int) -> bool:
        # Each dead letter's line is logged before its row commits.
        letters = list(DeadLetter.objects.values_list("pk", flat=True))
        log = worker.log_text()
        return len(letters) == count and all(f"dead letter #{pk}," in log for pk in letters)

    try:
        worker.wait_ready()
        post_event(client, stripe_events.encode(paid_event(customer_email="typo@exmaple.com")))
        assert wait_until(lambda: failed(1), timeout=30)
        smtp.handler.faults.always = "451 4.3.0 try again later"
        post_event(client, stripe_events.encode(paid_event(customer_email="busy@example.com")))
        assert wait_until(lambda: failed(2), timeout=60)
        test_tasks.divide.enqueue(1, 0)
        assert wait_until(lambda: failed(3), timeout=30)
    finally:
        worker.stop()

    output = worker.log_text()
    errors = [(name, text) for level, name, text in log_records(output) if level != "INFO"]
    assert sorted(DeadLetter.objects.values_list("reason", flat=True)) == [
        "exhausted",
        "permanent",
        "permanent",
    ]
    [bug] = DeadLetter.objects.filter(task=test_tasks.divide.module_path)
    assert bug.exception_class == "builtins.ZeroDivisionError"
    # Every traceback is kept where the operator replays from.
    for letter in DeadLetter.objects.all():
        assert letter.traceback.startswith("Traceback (most recent call last)"), letter

    assert len(errors) == 3, errors
    for letter in DeadLetter.objects.all():
        [(name, text)] = [e for e in errors if f"dead letter #{letter.pk}," in e[1]]
        assert name == "asyncwork.deadletters"
        first = text.splitlines()[0]
        for part in (letter.task, f"[{letter.task_id}]", json.dumps(letter.args), letter.reason):
            assert part in first, (part, first)
    assert "raised unexpected" not in output
    # One traceback in the whole output: the bug's, on its dead-letter line.
    assert output.count("Traceback (most recent call last)") == 1
    [(_, bug_line)] = [e for e in errors if f"dead letter #{bug.pk}," in e[1]]
    assert "Traceback (most recent call last)" in bug_line
    assert bug_line.rstrip().endswith("ZeroDivisionError: division by zero")


# --- What an operator reads: the failure in words, and what it was about -----------------------

DEAD_LETTERS = "/admin/asyncwork/deadletter/"
REFUSAL = "recipient refused: 550 5.1.1 mailbox unavailable (typo@exmaple.com)"


def operator() -> Client:
    staff = Client()
    staff.force_login(staff_user("op", groups=["operators"]))
    return staff


def test_the_list_says_which_invoice_for_whom_and_why_in_words(
    client: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)
    staff = operator()

    [row] = rows(staff.get(DEAD_LETTERS))

    assert row["pk"] == str(letter.pk)
    assert row["subject_link"] == f"invoice {invoice.number}"
    assert row["recipient"] == "typo@exmaple.com"
    assert row["failure"] == REFUSAL
    assert (row["reason"], row["attempts"]) == ("Permanent failure", "1")
    assert re.fullmatch(r"\d+ s", row["age"])
    assert row["replayed_at"] == "waiting"
    page = staff.get(DEAD_LETTERS).content.decode()
    assert f'href="/admin/invoicing/invoice/{invoice.pk}/change/"' in page
    # Not the exception class alone, nor a bare argument list.
    assert "asyncwork.errors.PermanentError" not in page
    assert f"[{invoice.pk}]" not in page
    # The stored message is the words; smtplib's raw reply stays in the traceback.
    assert letter.exception_message == REFUSAL
    assert "SMTPRecipientsRefused" in letter.traceback
    assert "(550, b'5.1.1 mailbox unavailable')" in letter.traceback

    dlq("replay", str(letter.pk), "--force")
    letter.refresh_from_db()
    [row] = rows(staff.get(DEAD_LETTERS))
    # What became of the replay: its job, published, with no worker running here.
    assert row["outcome"].startswith(f"job {letter.replay_job_id} published ")
    assert re.fullmatch(
        rf"replayed by {re.escape(cli_actor())} at \d{{4}}-\d\d-\d\d \d\d:\d\d UTC",
        row["replayed_at"],
    )


def test_the_page_replays_with_its_button_folds_the_traceback_and_keeps_the_history(
    client: Client, smtp: SmtpServer
) -> None:
    viewer = Client()
    viewer.force_login(staff_user("watcher", groups=["viewers"]))
    staff = Client(enforce_csrf_checks=True)
    staff.force_login(staff_user("op", groups=["operators"]))
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)
        page_url = f"{DEAD_LETTERS}{letter.pk}/change/"
        replay_url = f"{DEAD_LETTERS}{letter.pk}/replay/"

        page = staff.get(page_url).content.decode()
        assert f'action="{replay_url}"' in page  # the Replay button, a POST form
        assert REFUSAL in page
        folded = re.search(r"<details class=\"traceback\"><summary>Traceback \(\d+ lines\)", page)
        assert folded is not None
        assert page.index("SMTPRecipientsRefused") > folded.start()
        assert f'href="/admin/invoicing/invoice/{invoice.pk}/change/"' in page
        # A viewer sees the page without the button, and cannot replay by posting.
        assert f'action="{replay_url}"' not in viewer.get(page_url).content.decode()
        assert viewer.post(replay_url).status_code == 403
        assert staff.get(replay_url).status_code == 405
        assert staff.post(replay_url).status_code == 403  # no CSRF token
        letter.refresh_from_db()
        assert letter.replayed_at is None

        invoice_recipient_correct(
            invoice_id=invoice.pk, email="fixed@example.com", reason="typo", actor="admin:op"
        )
        token = staff.cookies["csrftoken"].value
        replayed = staff.post(replay_url, {"csrfmiddlewaretoken": token}, follow=True)
        assert replayed.redirect_chain == [(page_url, 302)]
        assert changelist_messages(replayed) == [
            ("success", f"Replayed dead letter {letter.pk}: its job is queued again.")
        ]
        smtp.handler.wait_for(1, timeout=20)
        again = staff.post(replay_url, {"csrfmiddlewaretoken": token}, follow=True)
        [(level, text)] = changelist_messages(again)
        assert level == "warning"
        assert text.startswith(f"Dead letter {letter.pk} was already replayed by admin:op at ")
        pipeline_quiet()

    assert [m["To"] for m in smtp.messages] == ["Jenny Rosen <fixed@example.com>"]
    page = staff.get(page_url).content.decode()
    assert f'action="{replay_url}"' not in page  # replayed: nothing left to replay
    assert "replayed by admin:op at " in page
    # The history: each replay asked for, by whom, and what it came to.
    history = OperatorAction.objects.filter(action="dead_letter.replay").order_by("pk")
    assert [(a.actor, a.detail.split(":")[0]) for a in history] == [
        ("admin:op", "replayed"),
        ("admin:op", "skipped"),
    ]
    for action in history:
        assert action.detail in page


def test_dlq_list_prints_the_reason_in_words_and_the_invoice_within_100_columns(
    client: Client, smtp: SmtpServer
) -> None:
    with worker_thread():
        invoice, letter = refused_invoice_dead_letter(client, smtp)
    long = paid_invoice(number="INV-" + "9" * 40, customer_email="a" * 60 + "@example.com")
    other = recorded("t-long")
    assert other is not None
    DeadLetter.objects.filter(pk=other.pk).update(args=[long.pk], exception_message="x" * 300)
    unknown = recorded("t-unknown")
    assert unknown is not None
    DeadLetter.objects.filter(pk=unknown.pk).update(task="core.gone", args=[7])

    lines = dlq("list").splitlines()

    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    assert re.fullmatch(
        r" *ID AGE +REASON +SUBJECT +RECIPIENT +TRIES REPLAYED FAILURE", lines[0]
    ), lines[0]
    by_id = {line.split()[0]: line for line in lines[1:]}
    refused = re.fullmatch(
        rf" *{letter.pk} \d+ s +permanent +{re.escape(invoice.number)} +typo@exmaple\.com +1 "
        r"waiting +(?P<failure>.+)",
        by_id[str(letter.pk)],
    )
    assert refused is not None, by_id[str(letter.pk)]
    failure = refused["failure"]
    assert failure.endswith("\u2026")  # cut to what the line leaves, and says so
    assert REFUSAL.startswith(failure[:-1])
    # As much as the line leaves: the wider the ids (the run's earlier tests), the less.
    assert failure.startswith("recipient refused: 550 5.1.1")
    assert len(by_id[str(letter.pk)]) == 100
    cut = re.fullmatch(
        rf" *{other.pk} \d+ s +permanent +INV-9{{7}}\u2026 +a{{15}}\u2026 +1 waiting +x+\u2026",
        by_id[str(other.pk)],
    )
    assert cut is not None, by_id[str(other.pk)]
    assert re.fullmatch(
        rf" *{unknown.pk} \d+ s +permanent +core\.gone\[7\] +- +1 waiting +nope",
        by_id[str(unknown.pk)],
    ), by_id[str(unknown.pk)]

    listed = {row["id"]: row for row in json.loads(dlq("list", "--json"))}
    row = listed[letter.pk]
    assert {
        "id",
        "task",
        "task_id",
        "args",
        "kwargs",
        "reason",
        "exception_class",
        "exception_message",
        "attempts",
        "first_failed_at",
        "last_failed_at",
        "created_at",
        "replayed_at",
        "replayed_by",
    } <= set(row)
    outcome = row["subject"].pop("outcome")  # the invoicing app's words
    assert row["subject"] == {
        "kind": "invoice",
        "label": invoice.number,
        "recipient": "typo@exmaple.com",
        "url": f"/admin/invoicing/invoice/{invoice.pk}/change/",
    }
    assert isinstance(outcome, str)
    assert outcome
    assert row["failure"] == REFUSAL
    assert row["replay_state"] == "waiting"
    assert row["age_seconds"] >= 0
    assert listed[unknown.pk]["subject"] is None


def test_dlq_replay_with_no_arguments_explains_its_two_forms() -> None:
    with pytest.raises(CommandError) as refused:
        dlq("replay")
    assert "dlq replay ID [ID ...]" in str(refused.value)
    assert "dlq replay --all" in str(refused.value)
    result = python("manage.py", "dlq", "replay")
    assert result.returncode == 1
    assert "manage.py dlq replay ID [ID ...]" in result.stderr
    assert "manage.py dlq replay --all" in result.stderr
    assert "Traceback" not in result.stderr
    assert not OperatorAction.objects.exists()
