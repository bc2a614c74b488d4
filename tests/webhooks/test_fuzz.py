"""Hostile input: generated bodies, headers and timestamps never give a 5xx, and nothing
without a valid signature is ever stored.

Signed events are hostile too: every string field (keys of unknown fields included) may carry
lone surrogates (valid JSON as ``\\ud800``, unencodable as UTF-8), NUL and the other controls
that break a header line, separators, bidi overrides and look-alike text. Such an event is
answered below 500, stored byte for byte as signed if at all, and its email is either built
with no header a sender could inject or refused as a permanent error."""

from __future__ import annotations

import email
import email.policy
import json
import time
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import event as outcome
from hypothesis import strategies as st

from asyncwork.errors import PermanentError
from invoicing.models import Invoice
from invoicing.services import PAYMENT_EVENT_TYPES
from invoicing.tasks import invoice_email_build
from stack import stripe_events
from tests.helpers.stripe import SECRET, WEBHOOK_URL, paid_event, post_event
from webhooks.models import WebhookEvent
from webhooks.stripe import WebhookRejected, signature_verify

pytestmark = pytest.mark.django_db

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# What no well-behaved sender puts in a field: lone surrogates, NUL, every character Python's
# email package breaks a header line on, bidi and zero-width characters, the replacement
# character, and pieces of addresses, headers and URLs.
HOSTILE_PIECES = [
    "\ud800",
    "\udbff",
    "\udc00",
    "\udfff",
    "\ud83d",
    "\x00",
    "\t",
    "\n",
    "\r\n",
    "\v",
    "\f",
    "\x1c",
    "\x1d",
    "\x1e",
    "\x7f",
    "\x85",
    "\x9b",
    "\u2028",
    "\u2029",
    "\u202e",
    "\u200b",
    "\ufeff",
    "\ufffd",
    "\\",
    '"',
    "@",
    "<",
    ">",
    ",",
    ":",
    "Bcc: victim@evil.example",
    "=?utf-8?q?x?=",
    "javascript:",
    "https://invoice.stripe.com@evil.example/",
    "xn--",
    "ä",
    "ß",
    "中",
    " ",
]
# st.text() never draws a surrogate; st.characters() (no codec) sometimes does.
hostile_text = st.lists(
    st.sampled_from(HOSTILE_PIECES) | st.text(st.characters(), max_size=4), max_size=8
).map("".join)
texts = st.text() | hostile_text

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=20,
)
event_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(texts, st.integers(), st.none()),
        "type": st.sampled_from(["invoice.paid", "invoice.payment_succeeded", "x"]) | texts,
        "object": st.sampled_from(["event", "v2.core.event"]) | texts,
        "api_version": json_values,
        "account": texts,
        "context": texts | st.none(),
        "created": st.one_of(st.integers(), st.text(), st.none()),
        "related_object": json_values,
        "livemode": json_values,
        "data": st.fixed_dictionaries(
            {},
            optional={
                "object": st.dictionaries(
                    st.sampled_from(
                        [
                            "id",
                            "number",
                            "customer_email",
                            "customer_name",
                            "amount_paid",
                            "currency",
                            "status",
                            "status_transitions",
                            "hosted_invoice_url",
                        ]
                    ),
                    json_values,
                )
            },
        )
        | json_values,
    },
)
headers = st.one_of(
    st.text(max_size=200),
    st.builds(lambda t, v: f"t={t},v1={v}", st.integers(), st.text(max_size=80)),
    st.builds(lambda items: ",".join(items), st.lists(st.text(max_size=30), max_size=6)),
)


@FUZZ
@given(body=st.binary(max_size=2000), header=headers)
def test_unsigned_garbage_is_4xx_and_stores_nothing(
    client: Client, body: bytes, header: str
) -> None:
    response = client.post(
        WEBHOOK_URL, data=body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )
    assert 400 <= response.status_code < 500
    assert not WebhookEvent.objects.exists()


@FUZZ
@given(
    event=event_like,
    raw=st.binary(max_size=500),
    use_raw=st.booleans(),
    escape=st.booleans(),
    skew=st.integers(min_value=-1000, max_value=1000),
)
@pytest.mark.slow
def test_validly_signed_arbitrary_bodies_never_5xx(
    client: Client, event: dict[str, Any], raw: bytes, use_raw: bool, escape: bool, skew: int
) -> None:
    # Escaped, a lone surrogate is valid JSON in valid UTF-8 (\ud800); unescaped it has no
    # UTF-8 form, and its surrogatepass bytes are not UTF-8 (a 400).
    text = json.dumps(event, ensure_ascii=escape)
    body = raw if use_raw else text.encode("utf-8", "surrogatepass")
    timestamp = int(time.time()) + skew
    header = stripe_events.signature_header(body, SECRET, timestamp=timestamp)
    before = WebhookEvent.objects.count()
    response = client.post(
        WEBHOOK_URL, data=body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )
    assert response.status_code < 500
    if abs(skew) > 300:
        assert response.status_code == 400
    if response.status_code != 200:
        assert WebhookEvent.objects.count() == before
    elif not response.json()["duplicate"]:
        stored = WebhookEvent.objects.get(event_id=response.json()["event_id"])
        assert stored.body.encode() == body  # what was signed, byte for byte


@st.composite
def hostile_events(draw: st.DrawFn) -> dict[str, Any]:
    """A realistic signed event (stack/stripe_events.py), with hostile text drawn into any of its
    string fields, and unknown fields with hostile keys added at any level."""
    event = paid_event(
        event_type=draw(st.sampled_from([*sorted(PAYMENT_EVENT_TYPES) * 2, "customer.created"]))
    )
    event["livemode"] = draw(st.sampled_from([False] * 5 + [True]))  # tests act on test mode

    def mutate(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            out = {k: mutate(item, k) for k, item in value.items()}
            if draw(st.integers(0, 4)) == 0:
                out[draw(hostile_text)] = draw(json_values)
            return out
        if isinstance(value, list):
            return [mutate(item, key) for item in value]
        # Identifiers and the address less often, so that most events get as far as the
        # invoice and its email.
        odds = {"id": 1, "type": 1, "currency": 1, "status": 1, "customer_email": 2}.get(key, 5)
        if isinstance(value, str) and draw(st.integers(0, 9)) < odds:
            return draw(hostile_text)
        return value

    return mutate(event)


HEADERS_OF_THE_EMAIL = {
    "Content-Type",
    "MIME-Version",
    "Subject",
    "From",
    "To",
    "Date",
    "Message-ID",
}


@FUZZ
@given(event=hostile_events())
@pytest.mark.slow
def test_hostile_text_in_every_field_of_a_signed_event(
    client: Client, event: dict[str, Any]
) -> None:
    body = json.dumps(event).encode()  # lone surrogates as \ud800 escapes: valid, signed
    before = WebhookEvent.objects.count()

    response = post_event(client, body)

    assert response.status_code < 500
    outcome(f"{response.status_code} {response.json().get('error', '')}")
    if response.status_code != 200:
        assert response.status_code == 400
        assert WebhookEvent.objects.count() == before
        return
    if response.json()["duplicate"]:
        return
    stored = WebhookEvent.objects.get(event_id=response.json()["event_id"])
    assert stored.body.encode() == body  # what was signed, byte for byte
    outcome(f"stored {stored.state}")
    if stored.state != WebhookEvent.State.PROCESSED:
        return
    invoice = Invoice.objects.get(provider_invoice_id=event["data"]["object"]["id"])
    # The email the worker would build: no header but ours, nothing injected, or a
    # permanent error (an address that cannot be repaired) for the dead letter.
    try:
        message = invoice_email_build(invoice=invoice, message_id="<fuzz@example.com>", key="fuzz")
    except PermanentError as exc:
        outcome(f"email refused: {str(exc).split(':')[0]}")
        return
    outcome("email built")
    # Django's MIMEMixin.as_bytes takes linesep; the stubs type message() as a plain Message.
    raw = message.message().as_bytes(linesep="\r\n")  # type: ignore[call-arg]
    parsed = email.message_from_bytes(raw, policy=email.policy.default)
    assert set(parsed.keys()) == HEADERS_OF_THE_EMAIL
    assert parsed.defects == []
    assert len(parsed["To"].addresses) == 1
    assert message.recipients() == message.to  # one recipient, in the envelope too


@FUZZ
@given(
    payload=st.binary(max_size=300),
    header=st.text(max_size=300),
    now=st.floats(min_value=0, max_value=2e10),
)
def test_verifier_only_ever_raises_webhook_rejected(
    payload: bytes, header: str, now: float
) -> None:
    try:
        signature_verify(payload=payload, header=header, secrets=[SECRET], tolerance=300, now=now)
    except WebhookRejected:
        return
    pytest.fail("a header not made with the secret was accepted")
