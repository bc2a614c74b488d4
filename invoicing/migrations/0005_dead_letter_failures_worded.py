"""The invoice emails' dead letters whose stored failure is Python's repr of smtplib's values
(``recipient refused: {'x@y': (550, b'5.1.1 ...')}``, ``SMTP 550: b'5.7.1 ...'``) rewritten
in the words ``invoicing.mail.deliver`` stores (``recipient refused: 550 5.1.1 ... (x@y)``,
``SMTP 550 5.7.1 ...``), so that every reader shows the stored message as it stands."""

import ast
import re
from typing import Any

from django.db import migrations

from invoicing.mail import refused_recipients_text, smtp_reply_text

_TASKS = ("invoicing.send_invoice_email", "invoicing.resend_invoice_email")
_REFUSAL = re.compile(r"recipient (refused|deferred): (\{.*\})", re.DOTALL)
_REPLY = re.compile(r"SMTP (\d{3}): (b'.*'|b\".*\")", re.DOTALL)


def _worded(message: str) -> str:
    try:
        if refusal := _REFUSAL.fullmatch(message):
            recipients = ast.literal_eval(refusal[2])
            return f"recipient {refusal[1]}: {refused_recipients_text(recipients)}"
        if reply := _REPLY.fullmatch(message):
            return f"SMTP {smtp_reply_text(int(reply[1]), ast.literal_eval(reply[2]))}"
    except (ValueError, TypeError, SyntaxError, AttributeError, MemoryError, RecursionError):
        pass  # not smtplib's values after all: left as stored
    return message


def dead_letter_failures_word(apps: Any, schema_editor: Any) -> None:
    DeadLetter = apps.get_model("asyncwork", "DeadLetter")
    letters = DeadLetter.objects.filter(
        task__in=_TASKS,
        exception_message__regex=r"^(recipient (refused|deferred): \{|SMTP [0-9]{3}: b)",
    ).only("pk", "exception_message")
    worded = []
    for letter in letters.iterator(chunk_size=1000):
        words = _worded(letter.exception_message)
        if words != letter.exception_message:
            letter.exception_message = words
            worded.append(letter)
    DeadLetter.objects.bulk_update(worded, ["exception_message"], batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [
        ("invoicing", "0004_email_delivery_sending_index"),
        ("asyncwork", "0005_deadletter_drop_broker_copy"),
    ]

    operations = [
        migrations.RunPython(dead_letter_failures_word, migrations.RunPython.noop, elidable=True),
    ]
