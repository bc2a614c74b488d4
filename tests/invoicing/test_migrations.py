"""Migrating forward: the invoice emails' dead letters stored with Python's repr of smtplib's
values as their failure are rewritten in the words ``invoicing.mail.deliver`` stores, every other
dead letter keeping its message as it was; and the email tasks' jobs and dead letters written
under their Celery names are named by the tasks' module paths, so they run and replay, every
other task's left as it was."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from asyncwork.deadletters import refusals, subjects
from asyncwork.models import DeadLetter, Job
from asyncwork.tasks import task_for
from invoicing.tasks import resend_invoice_email, send_invoice_email
from tests.helpers.factories import paid_invoice

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("invoicing", "0004_email_delivery_sending_index")]
SEND = "invoicing.send_invoice_email"
RESEND = "invoicing.resend_invoice_email"
# Each Celery name, as the tasks' module path names them since.
NAMED = {SEND: send_invoice_email.module_path, RESEND: resend_invoice_email.module_path}

# (task, as stored, as read after the migration)
LETTERS = [
    (
        SEND,
        "recipient refused: {'Jenny Rosen <jenny@exmaple.com>': "
        "(550, b'5.1.1 mailbox unavailable')}",
        "recipient refused: 550 5.1.1 mailbox unavailable (jenny@exmaple.com)",
    ),
    (
        RESEND,
        "recipient deferred: {'a@example.com': (451, b'4.3.0 try later'), "
        "'b@example.com': (452, b'4.2.2 full')}",
        "recipient deferred: 451 4.3.0 try later (a@example.com); 452 4.2.2 full (b@example.com)",
    ),
    (SEND, "SMTP 550: b'5.7.1 message rejected'", "SMTP 550 5.7.1 message rejected"),
    (SEND, 'SMTP 554: b"5.7.1 can\'t\\nsend"', "SMTP 554 5.7.1 can't send"),
    (SEND, "SMTP 550: b'5.7.1 \\x00nul'", "SMTP 550 5.7.1 nul"),
    # Already in words, or not what deliver() wrote: as stored.
    *(
        (SEND, stored, stored)
        for stored in (
            "recipient refused: 550 5.1.1 mailbox unavailable (jenny@example.com)",
            "recipient refused: {'x': __import__('os')}",
            "recipient refused: {'x@y': 550}",
            "SMTP 550: b'unterminated",
            "invoice 42 does not exist",
        )
    ),
    # Another task's message is another app's words.
    ("core.other", "SMTP 550: b'5.7.1 message rejected'", "SMTP 550: b'5.7.1 message rejected'"),
]


def _migrate(targets: list[tuple[str, str]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def test_stored_smtplib_values_are_rewritten_in_words_and_nothing_else_changes() -> None:
    _migrate(BEFORE)
    loader = MigrationExecutor(connection).loader
    old: Any = loader.project_state([*BEFORE, *loader.graph.leaf_nodes("asyncwork")]).apps
    now = timezone.now()
    stored = old.get_model("asyncwork", "DeadLetter").objects.bulk_create(
        old.get_model("asyncwork", "DeadLetter")(
            task=task,
            task_id=f"wording-{n}",
            args=[n],
            queue="email",
            reason="permanent",
            exception_message=message,
            traceback=f"traceback {n}",
            attempts=1,
            first_failed_at=now,
            last_failed_at=now,
        )
        for n, (task, message, _) in enumerate(LETTERS)
    )

    _migrate(list(MigrationExecutor(connection).loader.graph.leaf_nodes()))

    after = {x.pk: x for x in DeadLetter.objects.all()}
    assert len(after) == len(LETTERS)
    for letter, (task, _, words) in zip(stored, LETTERS, strict=True):
        migrated = after[letter.pk]
        assert (migrated.task, migrated.exception_message) == (NAMED.get(task, task), words)
        assert migrated.traceback == letter.traceback


BEFORE_NAMES = [("invoicing", "0008_email_delivery_provider_message_id")]


def test_the_email_jobs_and_dead_letters_are_named_as_the_code_names_its_tasks() -> None:
    _migrate(BEFORE_NAMES)
    loader = MigrationExecutor(connection).loader
    old: Any = loader.project_state([*BEFORE_NAMES, *loader.graph.leaf_nodes("asyncwork")]).apps
    invoice = paid_invoice()
    now = timezone.now()
    for n, task in enumerate((SEND, RESEND, "core.other")):
        # A retry due later, as the outbox kept it, and a dead letter, each under the old name.
        old.get_model("asyncwork", "Job").objects.create(
            task=task, args=[invoice.pk], queue="email", due_at=now
        )
        old.get_model("asyncwork", "DeadLetter").objects.create(
            task=task,
            task_id=f"naming-{n}",
            args=[invoice.pk],
            queue="email",
            reason="permanent",
            attempts=1,
            first_failed_at=now,
            last_failed_at=now,
        )

    _migrate(list(MigrationExecutor(connection).loader.graph.leaf_nodes()))

    expected = [send_invoice_email.module_path, resend_invoice_email.module_path, "core.other"]
    assert list(Job.objects.order_by("pk").values_list("task", flat=True)) == expected
    letters = list(DeadLetter.objects.order_by("pk"))
    assert [letter.task for letter in letters] == expected
    # The code has each renamed task: its jobs run, its letters are described and replayable.
    assert [task_for(name) for name in expected[:2]] == [send_invoice_email, resend_invoice_email]
    send_letter = letters[0]
    assert set(subjects([send_letter])) == {send_letter.pk}
    assert set(refusals(letters)) == {letters[2].pk}  # only the task the code lacks

    _migrate(BEFORE_NAMES)  # and back: the names they had
    assert list(Job.objects.order_by("pk").values_list("task", flat=True)) == [
        SEND,
        RESEND,
        "core.other",
    ]
