"""``python -m stack.stripe_trigger`` against a live server, run as a developer runs it: every
event type Stripe's CLI triggers, signed as Stripe signs with the settings' secret, taken
(applied when handled, stored ignored otherwise); duplicates and stale timestamps behave as real
deliveries do; bad input and an unknown type are one line and exit status 1."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from typing import Any, cast

import pytest

from invoicing.models import Invoice
from stack import stripe_events, stripe_trigger
from stack.process import ROOT
from stack.standin import JsonHandler, StandIn, StandInServer
from tests.helpers.environment import clean_env, settings_read
from tests.helpers.processes import python
from webhooks import stripe as webhook_events
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m stack.stripe_trigger <args>`` in the environment of this test's processes
    (its settings, and so its webhook secret, are the live server's)."""
    return python("-m", "stack.stripe_trigger", *args)


def trigger(live_server: Any, *args: str) -> str:
    """What the script printed, once it exited 0 having said nothing on stderr."""
    done = run(*args, "--url", f"{live_server.url}/webhooks/stripe/")
    assert (done.returncode, done.stderr) == (0, ""), done
    return done.stdout


def refused(live_server: Any, *args: str) -> str:
    """The one line on stderr of a run that exited 1."""
    done = run(*args, "--url", f"{live_server.url}/webhooks/stripe/")
    assert done.returncode == 1, done
    [line] = done.stderr.splitlines()
    assert line.startswith("python -m stack.stripe_trigger: error: "), line
    return line


def test_repeat_delivers_one_event_three_times(live_server: Any) -> None:
    out = trigger(
        live_server,
        "invoice.paid",
        "--repeat",
        "3",
        "--invoice-id",
        "in_trigger1",
        "--customer-email",
        "t@example.com",
    )
    assert out.count(": 200 ") == 3
    assert out.count('"duplicate": true') == 2
    event = WebhookEvent.objects.get()
    assert event.type == "invoice.paid"
    assert ",v0=" in event.headers["Stripe-Signature"]  # the fake v0 test mode sends
    assert event.headers["User-Agent"].startswith("Stripe/1.0")
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.customer_email) == ("in_trigger1", "t@example.com")


@pytest.mark.parametrize(
    ("args", "email", "name"),
    [
        ((), "jenny.rosen@example.com", "Jenny Rosen"),
        (("--customer-email", "t@example.com"), "t@example.com", ""),
        (
            ("--customer-email", "t@example.com", "--customer-name", "Ada Lovelace"),
            "t@example.com",
            "Ada Lovelace",
        ),
        (("--customer-name", "Ada Lovelace"), "jenny.rosen@example.com", "Ada Lovelace"),
    ],
    ids=["defaults", "email-only", "email-and-name", "name-only"],
)
def test_the_recipient_is_the_one_given_with_no_one_elses_name(
    live_server: Any, args: tuple[str, ...], email: str, name: str
) -> None:
    trigger(live_server, "invoice.paid", *args)
    invoice = Invoice.objects.get()
    assert (invoice.customer_email, invoice.customer_name) == (email, name)
    sent = json.loads(WebhookEvent.objects.get().body)["data"]["object"]
    assert sent["customer_name"] == (name or None)  # as Stripe sends a customer with no name


def test_several_event_types_for_one_invoice(live_server: Any) -> None:
    for event_type in (
        "invoice.payment_failed",
        "invoice.paid",
        "invoice.payment_succeeded",
        "customer.created",
    ):
        trigger(live_server, event_type, "--invoice-id", "in_trigger2")
    assert WebhookEvent.objects.count() == 4
    assert Invoice.objects.get().status == "paid"


def test_stale_is_refused_with_a_clear_error(live_server: Any) -> None:
    done = run("invoice.paid", "--stale", "--url", f"{live_server.url}/webhooks/stripe/")
    assert done.returncode == 1
    assert done.stdout.startswith("delivery 1: 400 ")
    assert done.stderr.endswith(": error: 1 of 1 deliveries were not accepted\n")
    assert not WebhookEvent.objects.exists()


def test_bad_arguments_are_clear_errors(live_server: Any) -> None:
    assert refused(live_server, "invoice.paid", "--repeat", "0").endswith(
        "--repeat must be at least 1"
    )
    assert "(in_...)" in refused(live_server, "invoice.paid", "--invoice-id", "bogus")
    done = run("invoice.paid", "--url", "ftp://127.0.0.1/")
    assert done.returncode == 1
    assert done.stderr.endswith(": error: --url must be an http:// or https:// URL\n")
    done = run("invoice.paid", "--repeat", "twice")
    assert done.returncode == 2  # argparse's own
    assert done.stderr.splitlines()[-1] == (
        "python -m stack.stripe_trigger: error: argument --repeat: invalid int value: 'twice'"
    )
    assert not WebhookEvent.objects.exists()


class _Receiver(JsonHandler):
    """Takes every POST, recording its body and ``Stripe-Signature``."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        receiver: Receiver = cast(StandInServer, self.server).api
        receiver.received.append((body, self.headers["Stripe-Signature"]))
        self.send_json(200, {"received": True})


class Receiver(StandIn):
    handler = _Receiver
    thread_name = "receiver"

    def __init__(self) -> None:
        super().__init__(hang_seconds=0)
        self.received: list[tuple[bytes, str]] = []


def test_it_signs_with_the_secret_the_receiver_reads_in_the_same_environment() -> None:
    """The README's "Try it by hand": DJANGO_DEBUG=1 and nothing else, in the receiver's
    terminal and in this one. The script signs with the secret that ``manage.py`` (and so
    gunicorn) reads there, with no option to say which."""
    env = {"DJANGO_DEBUG": "1"}
    [secrets] = settings_read("STRIPE_WEBHOOK_SECRETS", env=env)
    with Receiver() as receiver:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "stack.stripe_trigger",
                "invoice.paid",
                "--url",
                receiver.address,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=clean_env(**env),
        )
    assert (done.returncode, done.stdout) == (0, 'delivery 1: 200 {"received": true}\n'), done
    [(body, header)] = receiver.received
    webhook_events.signature_verify(
        payload=body, header=header, secrets=ast.literal_eval(secrets), tolerance=300
    )  # raises if no secret matches


def test_settings_that_do_not_load_are_one_line() -> None:
    """Production settings with no secret set: the line every entry point prints."""
    done = subprocess.run(
        [sys.executable, "-m", "stack.stripe_trigger", "invoice.paid"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("Configuration error: DJANGO_SECRET_KEY and STRIPE_WEBHOOK_SECRET must")


def test_every_type_the_cli_triggers_is_taken(
    live_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the script's ``main`` in this process (the same settings): a process for each of
    the 115 types would take minutes."""
    known = sorted(stripe_events.TRIGGER_OBJECTS)
    assert len(known) == 115
    assert {"invoice.voided", "charge.succeeded", "v1.billing.meter.no_meter_found"} < set(known)
    url = f"{live_server.url}/webhooks/stripe/"
    for event_type in known:
        args = [event_type, "--invoice-id", "in_every", "--amount", "4200", "--url", url]
        assert stripe_trigger.main(args) == 0, event_type
        out = capsys.readouterr().out
        assert out.startswith("delivery 1: 200 "), (event_type, out)

    stored = dict(WebhookEvent.objects.values_list("type", "state"))
    handled = {t for t in known if webhook_events.handler_for(t) is not None}
    assert handled == {"invoice.paid", "invoice.payment_succeeded"}
    assert stored == {t: "processed" if t in handled else "ignored" for t in known}
    invoice = Invoice.objects.get()
    assert (invoice.provider_invoice_id, invoice.amount_paid, invoice.status) == (
        "in_every",
        4200,
        "paid",
    )


def test_each_event_carries_the_object_its_type_names() -> None:
    voided = stripe_events.trigger_event("invoice.voided", invoice_id="in_void")["data"]["object"]
    assert (voided["object"], voided["id"], voided["status"]) == ("invoice", "in_void", "void")
    dispute = stripe_events.trigger_event("charge.dispute.created")["data"]["object"]
    assert (dispute["object"], dispute["id"][:3], dispute["amount"]) == ("dispute", "dp_", 2000)
    balance = stripe_events.trigger_event("balance.available")["data"]["object"]
    assert balance["object"] == "balance"
    assert "id" not in balance


def test_an_unknown_type_is_one_line_listing_the_known_ones(live_server: Any) -> None:
    line = refused(live_server, "invoice.bogus")
    assert line.startswith(
        "python -m stack.stripe_trigger: error: unknown event type 'invoice.bogus'"
    )
    known = line.split("; known: ")[1].split(", ")
    assert known == sorted(stripe_events.TRIGGER_OBJECTS)
    assert not WebhookEvent.objects.exists()
