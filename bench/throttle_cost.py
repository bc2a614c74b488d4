"""What one throttle check costs, and whether it counts right under concurrency.

Compares DRF's ``SimpleRateThrottle`` (GET + SET of a per-address list of timestamps) with the
webhook's fixed-window counter (``webhooks.throttle``: one Lua INCRBY + EXPIRE round trip per
batch of permits; batches of 1, a round trip per check, and of 10, the default), both on
Django's Redis cache, against the real Redis:

* median time per check for a quiet address (DRF's list holds a few hundred timestamps) and
  for a flooding one (5,500 requests made against the default limit of 6000/min);
* 8 threads x 100 requests from one address against a limit of 200: how many get through.

    .venv/bin/python -m bench.throttle_cost [--calls 2000]

Keys live under a prefix of their own in Redis database 13 and are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence

PREFIX = f"bench-throttle-{secrets.token_hex(4)}"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
# Production settings, as every benchmark measures them: DEBUG off, with throw-away secrets
# (nothing here is signed or served).
os.environ["DJANGO_DEBUG"] = "0"
os.environ["DJANGO_SECRET_KEY"] = secrets.token_urlsafe(50)
os.environ["STRIPE_WEBHOOK_SECRET"] = f"whsec_bench_{secrets.token_hex(16)}"
os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
os.environ["REDIS_KEY_PREFIX"] = PREFIX

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.cache import cache  # noqa: E402
from django.http import HttpRequest  # noqa: E402
from django.test import RequestFactory  # noqa: E402
from rest_framework.request import Request  # noqa: E402
from rest_framework.throttling import SimpleRateThrottle  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from webhooks.throttle import WebhookRateThrottle  # noqa: E402


class DrfThrottle(SimpleRateThrottle):
    """DRF's own algorithm, keyed the same way as the webhook throttle."""

    scope = "webhook-drf"

    def __init__(self, rate: str) -> None:
        self.rate = rate
        super().__init__()

    def get_cache_key(self, request: Request, view: APIView) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


def request_from(address: str) -> HttpRequest:
    return RequestFactory().post("/webhooks/stripe/", REMOTE_ADDR=address)


def per_call_us(check: Callable[[HttpRequest], bool], request: HttpRequest, calls: int) -> float:
    for _ in range(50):
        check(request)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        check(request)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def admitted(check: Callable[[HttpRequest], bool], threads: int, each: int) -> int:
    request = request_from(f"10.9.{secrets.randbelow(250)}.{secrets.randbelow(250)}")
    barrier = threading.Barrier(threads)
    results: list[bool] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        mine = [check(request) for _ in range(each)]
        with lock:
            results.extend(mine)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throttle_cost")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    settings.WEBHOOK_THROTTLE_RATE = "6000/min"

    def drf(rate: str) -> Callable[[HttpRequest], bool]:
        return lambda request: DrfThrottle(rate).allow_request(request, None)  # type: ignore[arg-type]

    def ours(request: HttpRequest) -> bool:
        return WebhookRateThrottle().allow_request(request, None)

    try:
        print(f"median time per check, {args.calls} calls, Redis {settings.REDIS_URL}")
        arms = (
            ("DRF SimpleRateThrottle", drf("6000/min"), 1),
            ("fixed window, batch 1", ours, 1),
            ("fixed window, batch 10", ours, 10),
        )
        for name, check, batch in arms:
            settings.WEBHOOK_THROTTLE_BATCH = batch  # permits taken per round trip
            fresh = per_call_us(check, request_from(f"10.0.0.{secrets.randbelow(250)}"), 200)
            # A flooding address: fill its history close to the limit, then measure.
            flooder = request_from(f"10.0.1.{secrets.randbelow(250)}")
            for _ in range(5500):
                check(flooder)
            full = per_call_us(check, flooder, min(args.calls, 400))
            print(f"  {name:<24} fresh address {fresh:8.1f} us   flooding address {full:8.1f} us")
        settings.WEBHOOK_THROTTLE_RATE = "200/min"
        settings.WEBHOOK_THROTTLE_BATCH = 1
        print("8 threads x 100 requests from one address, limit 200/min:")
        print(f"  DRF SimpleRateThrottle   admitted {admitted(drf('200/min'), 8, 100)}")
        print(f"  fixed window             admitted {admitted(ours, 8, 100)}")
    finally:
        client = cache._cache.get_client(write=True)  # type: ignore[attr-defined]
        keys = list(client.scan_iter(match=f"{PREFIX}:*"))
        if keys:
            client.delete(*keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
