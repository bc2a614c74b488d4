"""The nginx edge shipped in deploy/nginx (compose.yaml's ``edge`` service), run for real in
front of the application: webhooks over its rate are refused by nginx with 429 and never
reach Django; those admitted are stored."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import requests

from bench.edge import edge, rendered
from tests.conftest import SECRET, paid_event
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)


def test_edge_refuses_what_is_over_its_rate_before_the_application(live_server: Any) -> None:
    upstream = int(live_server.url.rsplit(":", 1)[1])
    bodies = [stripe_testing.encode(paid_event()) for _ in range(8)]
    statuses = []
    # 1 per second with a burst of 2: at most 3 of 8 back-to-back deliveries get through.
    with edge(upstream, rate=1, burst=2) as port:
        for body in bodies:
            response = requests.post(
                f"http://127.0.0.1:{port}/webhooks/stripe/",
                data=body,
                headers={
                    "Content-Type": "application/json",
                    "Stripe-Signature": stripe_testing.signature_header(body, SECRET),
                },
                timeout=10,
            )
            statuses.append(response.status_code)
            if response.status_code == 200:
                assert response.json()["duplicate"] is False
    admitted = [json.loads(b)["id"] for b, s in zip(bodies, statuses, strict=True) if s == 200]
    assert statuses.count(429) >= 5
    assert set(statuses) == {200, 429}
    # Only what nginx admitted reached the application, and all of it was stored.
    assert sorted(WebhookEvent.objects.values_list("event_id", flat=True)) == sorted(admitted)


def test_template_renders_only_its_own_settings() -> None:
    text = rendered(
        {
            "WEBHOOK_EDGE_RATE": 7,
            "WEBHOOK_EDGE_BURST": 3,
            "APP_UPSTREAM": "web:8000",
            "EDGE_LISTEN": 8080,
        }
    )
    assert "rate=7r/s" in text
    assert "burst=3 nodelay" in text
    assert "$proxy_add_x_forwarded_for" in text  # nginx's own variables are left alone
    assert not re.search(r"\$\{[A-Z]", text)
    with pytest.raises(ValueError, match="WEBHOOK_EDGE_BURST"):
        rendered({"WEBHOOK_EDGE_RATE": 7, "APP_UPSTREAM": "web:8000", "EDGE_LISTEN": 8080})
