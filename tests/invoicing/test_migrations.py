"""The invoice emails' dead letters stored with Python's repr of smtplib's values as their
failure are rewritten, by migrating forward, in the words ``invoicing.mail.deliver`` stores;
every other dead letter keeps its message as it was."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from asyncwork.models import DeadLetter

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("invoicing", "0004_email_delivery_sending_index")]
SEND = "invoicing.send_invoice_email"
RESEND = "invoicing.resend_invoice_email"

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
        assert (migrated.task, migrated.exception_message) == (task, words)
        assert migrated.traceback == letter.traceback
