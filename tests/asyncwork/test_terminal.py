"""Stored or requested text never drives a terminal: every command that prints such text (through
``asyncwork.logging.printable``), run as ``python manage.py`` (the kit's ``python -m
stack.stripe_trigger`` likewise) with hostile text in place, writes no control character to
stdout or stderr, its log lines included, only the line breaks it means: the address of a paid
invoice (``x<ESC>]0;pwned<BEL><ESC>[2J@example.com`` retitles the window and clears the screen)
through ``dlq`` and ``invoice show``, an operator's ``why`` sent through the API, a job's last
error, a username, and a provider's answers."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from asyncwork import deadletters
from asyncwork.contrib.periodic.jobs import jobs_declared
from asyncwork.models import DeadLetter, ScheduledJob
from invoicing.models import Invoice
from stack import stripe_events
from stack.net import wait_until
from stack.process import ROOT
from stack.smtp import SmtpServer
from stack.standin import JsonHandler, StandIn
from tests.helpers.factories import staff_user
from tests.helpers.processes import worker_env, worker_thread
from tests.helpers.stripe import paid_event, post_event

# What a customer's address held, as reproduced: sets the window's title, clears the screen.
ADDRESS = "x\x1b]0;pwned\x07\x1b[2J@example.com"
# An operator's or a provider's text: C1's one-byte CSI (\x9b) and a forged second line too.
HOSTILE = "fine\x1b]0;pwned\x07\x9b2J\r\nforged: line\x85"

pytestmark = pytest.mark.django_db(transaction=True)  # the commands read what the test wrote


def manage(*args: str, **settings: Any) -> subprocess.CompletedProcess[bytes]:
    """A real ``python manage.py <args>`` on this test's database; its raw output."""
    return python("manage.py", *args, **settings)


def python(*args: str, **settings: Any) -> subprocess.CompletedProcess[bytes]:
    """A real ``python <args>`` (``manage.py ...``, ``-m stack.stripe_trigger ...``) on this
    test's database; its raw output."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
        env=worker_env(0, settings),
    )


def terminal(done: subprocess.CompletedProcess[bytes]) -> str:
    """What the command wrote, stdout then stderr, once checked to hold no control character
    but the line feed: no byte 0x00-0x1f (ESC, BEL, CR...) but 0x0a, no DEL, and as UTF-8 no
    C1 control (U+0080-U+009F; a lone byte 0x80-0x9f, a one-byte CSI to a terminal that reads
    Latin-1, is no UTF-8 at all)."""
    raw = done.stdout + done.stderr
    c0 = sorted({f"{byte:#04x}" for byte in raw if (byte < 0x20 and byte != 0x0A) or byte == 0x7F})
    assert not c0, f"control bytes {c0} in {raw!r}"
    text = raw.decode()  # strictly
    c1 = sorted({f"{ord(c):#06x}" for c in text if 0x80 <= ord(c) <= 0x9F})
    assert not c1, f"C1 controls {c1} in {text!r}"
    return text


def test_a_hostile_address_and_why_reach_no_terminal_through_dlq_and_invoice_show(
    client: Client, smtp: SmtpServer
) -> None:
    """The reproduced case: the provider's address, refused by the send, is quoted by the
    replay check's refusal that ``dlq replay`` and its dry run print; an operator's ``why``,
    sent through the API, is what ``invoice show`` prints of the dead letter."""
    with worker_thread():
        post_event(client, stripe_events.encode(paid_event(customer_email=ADDRESS)))
        assert wait_until(DeadLetter.objects.exists, timeout=20)
    letter, invoice = DeadLetter.objects.get(), Invoice.objects.get()
    assert invoice.customer_email == ADDRESS  # stored as the provider sent it
    [refusal] = deadletters.refusals([letter]).values()
    assert ADDRESS in refusal
    escaped = "x\\x1b]0;pwned\\x07\\x1b[2J@example.com"

    replay = manage("dlq", "replay", str(letter.pk))
    dry_run = manage("dlq", "replay", str(letter.pk), "--dry-run")
    selected = manage("dlq", "replay", "--all", "--dry-run")
    listed = manage("dlq", "list")
    as_json = manage("dlq", "list", "--json")

    assert replay.returncode == 1
    assert f"dead letter {letter.pk} not replayed: '" in terminal(replay)
    assert escaped in terminal(replay)
    for done in (dry_run, selected):
        assert done.returncode == 0
        assert f"dead letter {letter.pk} would be refused: '" in terminal(done)
        assert escaped in terminal(done)
    assert listed.returncode == 0
    assert "'x\\x1b]0;" in terminal(listed)  # the recipient's column, cut to its width
    assert terminal(as_json)
    assert json.loads(as_json.stdout)[0]["subject"]["recipient"] == ADDRESS
    letter.refresh_from_db()
    assert letter.replayed_at is None

    operator = APIClient()
    operator.force_authenticate(staff_user("op", groups=["operators"]))
    resolved = operator.post(
        f"/api/dead-letters/{letter.pk}/resolve/", {"why": HOSTILE}, format="json"
    )
    assert resolved.status_code == 200
    letter.refresh_from_db()
    assert letter.resolved_why == HOSTILE.strip()  # stored as sent

    shown = manage("invoice", "show", str(invoice.pk))

    assert shown.returncode == 0
    text = terminal(shown)
    assert f"  Provider's address:  '{escaped}'" in text
    assert "\\x1b]0;pwned\\x07\\x9b2J\\r\\nforged: line" in text  # the why
    unknown = manage("invoice", "show", f"x{HOSTILE}")
    assert unknown.returncode == 1
    assert "no invoice has the id, provider's id or number 'xfine\\x1b]0;" in terminal(unknown)


@pytest.mark.parametrize(
    ("args", "status", "said"),
    [
        (["dlq", "replay", "--since", HOSTILE], 1, "--since: 'fine\\x1b]0;pwned"),
        (["dlq", "resolve", "--task", HOSTILE, "--dry-run"], 0, "0 dead letter(s) selected"),
        (["dlq", "replay", HOSTILE], 2, "invalid int value: 'fine\\x1b]0;pwned"),  # argparse's
    ],
)
def test_requested_text_in_a_commands_answer_is_escaped(
    args: list[str], status: int, said: str
) -> None:
    done = manage(*args)
    assert done.returncode == status
    assert said in terminal(done)


def test_a_jobs_stored_error_reaches_no_terminal_through_pipeline_status() -> None:
    name = jobs_declared()[0].name
    ScheduledJob.objects.update_or_create(name=name, defaults={"last_error": HOSTILE})

    done = manage("pipeline_status")

    assert "error: 'fine\\x1b]0;pwned\\x07\\x9b2J" in terminal(done)


def test_a_stored_username_reaches_no_terminal_through_api_token() -> None:
    get_user_model().objects.create_user(f"op{HOSTILE.strip()}", is_staff=True)

    issued = manage("api_token", "create", f"op{HOSTILE.strip()}")
    unknown = manage("api_token", "create", f"ghost{HOSTILE.strip()}")

    assert issued.returncode == 0, issued.stderr
    assert "token for 'opfine\\x1b]0;pwned\\x07\\x9b2J" in terminal(issued)
    assert unknown.returncode == 1
    assert "no user named 'ghostfine\\x1b]0;" in terminal(unknown)


class _Hostile(JsonHandler):
    """A provider whose answers carry control characters: a webhook receiver's raw body, and
    Stripe's JSON error whose message decodes to them."""

    def do_POST(self) -> None:
        self.send_json(400, HOSTILE.encode())

    def do_GET(self) -> None:
        error = {"type": "invalid_request_error", "message": HOSTILE}
        self.send_json(400, {"error": error})


class HostileProvider(StandIn):
    handler = _Hostile
    thread_name = "hostile-provider"


@pytest.fixture
def provider() -> Iterator[HostileProvider]:
    with HostileProvider(hang_seconds=0) as server:
        yield server


def test_a_providers_answers_reach_no_terminal_through_stripe_trigger_and_reconcile(
    provider: HostileProvider,
) -> None:
    trigger = python("-m", "stack.stripe_trigger", "invoice.paid", "--url", f"{provider.address}/")
    reconcile = manage(
        "stripe_reconcile",
        STRIPE_API_KEY="sk_test_hostile",
        STRIPE_API_BASE=provider.address,
        PROVIDER_API_ALLOWED_ORIGINS=[provider.address],
        STRIPE_API_TIMEOUT_SECONDS=2,
    )

    assert trigger.returncode == 1
    assert "delivery 1: 400 'fine\\x1b]0;pwned\\x07" in terminal(trigger)
    assert reconcile.returncode == 1
    assert "HTTP 400, fine\\x1b]0;pwned\\x07\\x9b2J" in terminal(reconcile)
