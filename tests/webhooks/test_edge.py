"""The nginx edge shipped in deploy/nginx (compose.yaml's ``edge`` service), run for real in
front of the application: webhooks over its rate are refused by nginx with 429 and never
reach Django; those admitted are stored."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from bench.edge import edge, rendered
from tests.conftest import WEBHOOK_URL, paid_event, post_signed
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)


def test_edge_refuses_what_is_over_its_rate_before_the_application(live_server: Any) -> None:
    upstream = int(live_server.url.rsplit(":", 1)[1])
    bodies = [stripe_testing.encode(paid_event()) for _ in range(8)]
    statuses = []
    # 1 per second with a burst of 2: at most 3 of 8 back-to-back deliveries get through.
    with edge(upstream, rate=1, burst=2, in_flight=4) as port:
        for body in bodies:
            response = post_signed(f"http://127.0.0.1:{port}{WEBHOOK_URL}", body)
            statuses.append(response.status_code)
            if response.status_code == 200:
                assert response.json()["duplicate"] is False
            else:  # nginx's refusal, in the application's shape
                assert response.json() == {"error": "rate limited"}
                assert response.headers["Retry-After"] == "1"
    admitted = [json.loads(b)["id"] for b, s in zip(bodies, statuses, strict=True) if s == 200]
    assert statuses.count(429) >= 5
    assert set(statuses) == {200, 429}
    # Only what nginx admitted reached the application, and all of it was stored.
    assert sorted(WebhookEvent.objects.values_list("event_id", flat=True)) == sorted(admitted)


def test_template_renders_only_its_own_settings() -> None:
    settings: dict[str, str | int] = {
        "WEBHOOK_EDGE_RATE": 7,
        "WEBHOOK_EDGE_BURST": 3,
        "WEBHOOK_EDGE_CONNECTIONS": 6,
        "APP_UPSTREAM": "web:8000",
        "EDGE_LISTEN": 8080,
    }
    text = rendered(settings)
    assert "rate=7r/s" in text
    assert "burst=3 nodelay" in text
    assert "limit_conn webhooks_in_flight 6;" in text
    assert "$proxy_add_x_forwarded_for" in text  # nginx's own variables are left alone
    assert not re.search(r"\$\{[A-Z]", text)
    del settings["WEBHOOK_EDGE_BURST"]
    with pytest.raises(ValueError, match="WEBHOOK_EDGE_BURST"):
        rendered(settings)


class SlowUpstream(http.server.BaseHTTPRequestHandler):
    """An upstream that takes 1 s per request, like gunicorn stuck behind a slow database."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(1)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_edge_refuses_what_is_over_its_in_flight_limit_at_once() -> None:
    """Under its rate but with the upstream slow: beyond ``in_flight`` requests at a time,
    nginx answers 503 at once rather than queueing them on gunicorn."""
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with edge(upstream.server_address[1], rate=1000, burst=100, in_flight=2) as port:

            def post(_: int) -> tuple[int, float, requests.Response]:
                started = time.monotonic()
                response = requests.post(
                    f"http://127.0.0.1:{port}/webhooks/stripe/", data=b"{}", timeout=10
                )
                return response.status_code, time.monotonic() - started, response

            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(post, range(6)))
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert sorted(status for status, _, _ in answers) == [200, 200, 503, 503, 503, 503]
    for status, seconds, response in answers:
        if status == 503:
            assert seconds < 1  # not queued behind the slow upstream
            assert response.json() == {"error": "overloaded"}
            assert response.headers["Retry-After"] == "1"


def test_the_healthchecks_compose_runs_pass_through_the_edge(live_server: Any) -> None:
    """compose.yaml's edge healthcheck fetches /health/live through nginx; anonymous /health/
    through it says the status alone."""
    upstream = int(live_server.url.rsplit(":", 1)[1])
    with edge(upstream, rate=50, burst=10, in_flight=4) as port:
        live = requests.get(f"http://127.0.0.1:{port}/health/live", timeout=10)
        ready = requests.get(f"http://127.0.0.1:{port}/health/", timeout=10)
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert set(ready.json()) == {"status"}
