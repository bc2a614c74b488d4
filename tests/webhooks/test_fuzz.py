"""Hostile input: generated bodies, headers and timestamps never give a 5xx, and nothing
without a valid signature is ever stored."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import SECRET, WEBHOOK_URL
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent
from webhooks.stripe import WebhookRejected, signature_verify

pytestmark = pytest.mark.django_db

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
event_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(max_size=300), st.integers(), st.none()),
        "type": st.sampled_from(["invoice.paid", "invoice.payment_succeeded", "x"]) | st.text(),
        "created": st.one_of(st.integers(), st.text(), st.none()),
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
    skew=st.integers(min_value=-1000, max_value=1000),
)
def test_validly_signed_arbitrary_bodies_never_5xx(
    client: Client, event: dict[str, Any], raw: bytes, use_raw: bool, skew: int
) -> None:
    body = raw if use_raw else json.dumps(event).encode()
    timestamp = int(time.time()) + skew
    header = stripe_testing.signature_header(body, SECRET, timestamp=timestamp)
    before = WebhookEvent.objects.count()
    response = client.post(
        WEBHOOK_URL, data=body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header
    )
    assert response.status_code < 500
    if abs(skew) > 300:
        assert response.status_code == 400
    if response.status_code != 200:
        assert WebhookEvent.objects.count() == before


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
