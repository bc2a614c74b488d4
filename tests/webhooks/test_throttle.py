"""The per-address rate limit on POST /webhooks/stripe/, against the real Redis cache."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
from django.core.cache import cache
from django.db import connection
from django.test import Client

from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST, free_port
from tests.helpers.processes import worker_env
from tests.helpers.stripe import WEBHOOK_URL, paid_event, post_event
from tests.helpers.throttle import an_address, fresh_window
from webhooks import testing as stripe_testing
from webhooks.models import WebhookEvent

pytestmark = pytest.mark.django_db


def ignored_event() -> bytes:
    return stripe_testing.encode(
        stripe_testing.event("customer.created", stripe_testing.customer_object())
    )


def test_over_the_limit_is_429_with_retry_after_and_stores_nothing(
    client: Client, settings: Any
) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "5/min"  # read when the request runs, not at import
    address = an_address()
    fresh_window()
    events = [paid_event() for _ in range(7)]

    responses = [post_event(client, stripe_testing.encode(e), REMOTE_ADDR=address) for e in events]

    assert [r.status_code for r in responses] == [200] * 5 + [429] * 2
    for refused in responses[5:]:
        assert refused.json() == {"error": "rate limited"}
        assert 1 <= int(refused["Retry-After"]) <= 60
    stored = set(WebhookEvent.objects.values_list("event_id", flat=True))
    assert stored == {e["id"] for e in events[:5]}


def test_another_address_is_unaffected(client: Client, settings: Any) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "2/min"
    flooder, other = an_address(), an_address()
    fresh_window()
    for _ in range(3):
        post_event(client, ignored_event(), REMOTE_ADDR=flooder)
    assert post_event(client, ignored_event(), REMOTE_ADDR=flooder).status_code == 429

    response = post_event(client, ignored_event(), REMOTE_ADDR=other)

    assert response.status_code == 200
    assert WebhookEvent.objects.count() == 3  # two from the flooder, one from the other


def test_the_throttle_runs_before_the_body_is_verified(client: Client, settings: Any) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "1/min"
    address = an_address()
    fresh_window()
    assert post_event(client, ignored_event(), REMOTE_ADDR=address).status_code == 200

    forged = post_event(client, ignored_event(), header="t=1,v1=00", REMOTE_ADDR=address)

    assert forged.status_code == 429  # not 400: the flood is refused without an HMAC
    assert WebhookEvent.objects.count() == 1


@pytest.mark.parametrize("trusted", [[], ["10.255.255.1"]])
def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(
    client: Client, settings: Any, trusted: list[str]
) -> None:
    """No trusted proxy, or a peer that is not one: a flood cannot dodge its limit by
    inventing an X-Forwarded-For."""
    settings.TRUSTED_PROXIES = trusted
    settings.WEBHOOK_THROTTLE_RATE = "2/min"
    address = an_address()
    fresh_window()
    statuses = [
        post_event(
            client, ignored_event(), REMOTE_ADDR=address, HTTP_X_FORWARDED_FOR=an_address()
        ).status_code
        for _ in range(4)
    ]
    assert statuses == [200, 200, 429, 429]


def test_behind_a_trusted_proxy_each_client_has_its_own_limit(
    client: Client, settings: Any
) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "1/min"
    proxy, first, second = an_address(), an_address(), an_address()
    settings.TRUSTED_PROXIES = [proxy]
    fresh_window()

    def via_proxy(client_address: str) -> int:
        return int(
            post_event(
                client,
                ignored_event(),
                REMOTE_ADDR=proxy,
                # The client may prepend anything; the proxy appends what it saw.
                HTTP_X_FORWARDED_FOR=f"{an_address()}, {client_address}",
            ).status_code
        )

    assert [via_proxy(first), via_proxy(first), via_proxy(second)] == [200, 429, 200]


def test_an_empty_rate_turns_the_throttle_off(client: Client, settings: Any) -> None:
    settings.WEBHOOK_THROTTLE_RATE = ""
    address = an_address()
    statuses = {
        post_event(client, ignored_event(), REMOTE_ADDR=address).status_code for _ in range(5)
    }
    assert statuses == {200}


def test_redis_unreachable_fails_open(
    client: Client, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "1/min"
    settings.CACHES = {
        "default": {
            **settings.CACHES["default"],
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        }
    }
    address = an_address()
    events = [paid_event() for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="webhooks.throttle"):
        statuses = [
            post_event(client, stripe_testing.encode(e), REMOTE_ADDR=address).status_code
            for e in events
        ]

    assert statuses == [200, 200, 200]
    assert WebhookEvent.objects.count() == 3
    # Logged once: after the first failure the throttle stops asking for a while.
    assert [r.getMessage() for r in caplog.records].count(
        "webhook throttle unavailable; letting requests through for 5 s"
    ) == 1


@contextmanager
def unanswering_port() -> Iterator[int]:
    """A port whose connections hang: a listener with a full backlog that never accepts (the
    SYN of a further connection is dropped, as for a host that vanished)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
    try:
        yield port
    finally:
        for sock in [*fillers, server]:
            sock.close()


def test_a_redis_that_does_not_answer_costs_one_short_timeout(
    client: Client, settings: Any
) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "1/min"
    events = [paid_event() for _ in range(5)]
    with unanswering_port() as port:
        settings.CACHES = {
            "default": {**settings.CACHES["default"], "LOCATION": f"redis://127.0.0.1:{port}/0"}
        }
        started = time.monotonic()
        statuses = [post_event(client, stripe_testing.encode(e)).status_code for e in events]
        elapsed = time.monotonic() - started

    assert statuses == [200] * 5
    assert WebhookEvent.objects.count() == 5
    # One WEBHOOK_THROTTLE_TIMEOUT (0.2 s), then the throttle is skipped: not one timeout per
    # request (1 s), nor the cache's own 1 s timeout.
    assert elapsed < 0.9


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_from_one_address_are_counted_exactly(settings: Any) -> None:
    settings.WEBHOOK_THROTTLE_RATE = "10/min"
    address = an_address()
    fresh_window(margin=10)
    bodies = [ignored_event() for _ in range(30)]
    barrier = threading.Barrier(10)
    statuses: list[int] = []
    lock = threading.Lock()

    def sender(mine: list[bytes]) -> None:
        try:
            client = Client()
            barrier.wait()
            codes = [post_event(client, body, REMOTE_ADDR=address).status_code for body in mine]
            with lock:
                statuses.extend(codes)
        finally:
            connection.close()

    threads = [threading.Thread(target=sender, args=(bodies[i::10],)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert sorted(statuses) == [200] * 10 + [429] * 20
    assert WebhookEvent.objects.count() == 10


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_processes_take_permits_in_batches_and_never_let_in_more_than_the_limit(
    tmp_path: Path,
) -> None:
    """Three gunicorn workers, 600/min (a batch of 6: a hundredth of the limit), 900 requests
    from one address: at most the limit let in, at most 5 permits per process left unused, and
    about one round trip to Redis per batch rather than one per request (the counter is raised
    by a whole batch per round trip). Unsigned bodies: the throttle answers before the body is
    read (429), a request it lets in is refused after it (400)."""
    limit, batch, workers, sent = 600, 6, 3, 900
    address = an_address()
    fresh_window(margin=30)
    env = worker_env(0, WEBHOOK_THROTTLE_RATE=f"{limit}/min", TRUSTED_PROXIES=HOST)
    with launch.gunicorn(
        env, config=GunicornConfig(workers=workers), log=tmp_path / "gunicorn.log"
    ) as server:
        url = f"http://{HOST}:{server.port}{WEBHOOK_URL}"
        headers = {"X-Forwarded-For": address, "Content-Type": "application/json"}

        def status(_: int) -> int:
            return requests.post(url, data=b"", headers=headers, timeout=10).status_code

        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = Counter(pool.map(status, range(sent)))
        window = int(time.time() // 60)

    assert set(statuses) == {400, 429}, statuses
    assert limit - (batch - 1) * workers <= statuses[400] <= limit, statuses
    counted = cache.get(f"throttle_webhook_{address}_{window}")
    assert counted % batch == 0
    # Permits taken: what was let in, what sits unused, and each process's one batch past the
    # limit that told it the window is spent; every refusal after that is answered locally.
    assert limit <= counted <= limit + batch * workers, counted
    assert counted // batch <= limit // batch + workers
