"""A rate limit per client address on the webhook endpoint, checked before the body is read.

DRF's throttle machinery (rate strings) without DRF's ``APIView``: the webhook stays a plain
Django view, which is the fast path. The address is the application's one client address
(``operators.http.client_address``: ``X-Forwarded-For`` counts only from ``TRUSTED_PROXIES``).

The algorithm is a fixed-window counter: the key ``throttle_webhook_<address>_<window>`` is
incremented (and given its expiry when created) by one Lua script, atomically, in one round
trip to Django's Redis cache. A process takes its permits in batches (``WEBHOOK_THROTTLE_BATCH``,
at most a hundredth of the limit): one increment by the batch, and the next requests of that
address in that window are let in from what it took, without a round trip; once the counter
has passed the limit, the process refuses the address until the window ends, again without one.
The counter still counts every permit taken, so never more than the limit is let in across
processes; the price is that up to (batch - 1) permits per process may be left unused when the
window ends (a sender refused that close to its limit). A batch of 1 is a round trip per
request and exact both ways. DRF's own ``SimpleRateThrottle.allow_request`` is not used. It
keeps a list of timestamps per address and GETs and SETs the whole pickled list on every
request, so its cost grows with the limit, exactly when a flood fills the list; and its
read-modify-write is not atomic, so concurrent requests from one address overwrite each
other's history and the flood it exists to stop is under-counted. ``bench/throttle_cost.py``
measures both. A fixed window admits at most twice the limit across a window boundary, which
is fine for a flood guard.

Fail open: when Redis does not answer within ``WEBHOOK_THROTTLE_TIMEOUT``, the request is
allowed and a WARNING is logged; the throttle is then skipped for ``FAIL_OPEN_SECONDS`` in
this process, so a hung Redis costs one short timeout, not one per request. The throttle must
never become the outage.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from django.http import HttpRequest
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry
from rest_framework.throttling import SimpleRateThrottle

from operators.http import client_address

if TYPE_CHECKING:
    from django.views import View

logger = logging.getLogger(__name__)

# After Redis failed to answer, this process stops asking it for this long.
FAIL_OPEN_SECONDS = 5.0

_skip_until: dict[str, float] = {}  # cache location -> monotonic time
_skip_lock = threading.Lock()


class WebhookRateThrottle(SimpleRateThrottle):
    """``settings.WEBHOOK_THROTTLE_RATE`` requests per window per client address.

    Instantiate one per request: the rate is read from settings then, not at import."""

    scope = "webhook"
    num_requests: int | None
    duration: int | None

    def __init__(self) -> None:
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)

    def get_rate(self) -> str | None:
        return settings.WEBHOOK_THROTTLE_RATE or None

    def get_cache_key(self, request: HttpRequest, view: View | None) -> str:
        ident = client_address(request) or "unknown"
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def allow_request(self, request: HttpRequest, view: View | None) -> bool:
        """Count this request in its window; False when the window's limit is exceeded.

        Raises ``RedisError`` when the cache does not answer (the caller fails open)."""
        if self.num_requests is None or self.duration is None:
            return True
        self.now = self.timer()
        window = int(self.now // self.duration)
        self.window_end = (window + 1) * self.duration
        self.key = f"{self.get_cache_key(request, view)}_{window}"
        batch = min(settings.WEBHOOK_THROTTLE_BATCH, max(1, self.num_requests // 100))
        self.allowed, self.first_refusal = _permits.take(
            self.key, limit=self.num_requests, batch=batch, ttl=self.duration + 1
        )
        return self.allowed

    def wait(self) -> float:
        """Seconds until the current window ends."""
        return max(self.window_end - self.now, 0.0)


# INCRBY, and EXPIRE on the first hit of a window, as one atomic command: a process dying
# between the two cannot leave a key without an expiry.
_HIT = (
    "local n = redis.call('INCRBY', KEYS[1], ARGV[2]) "
    "if n == tonumber(ARGV[2]) then redis.call('EXPIRE', KEYS[1], ARGV[1]) end "
    "return n"
)
_HIT_SHA = hashlib.sha1(_HIT.encode(), usedforsecurity=False).hexdigest()


@dataclass
class _Held:
    """What this process holds of one address's window."""

    left: int = 0  # permits taken from the shared counter and not used yet
    spent: bool = False  # the counter has reached the limit: nothing more to take this window


class _Permits:
    """This process's permits, per key (an address and its window)."""

    # Keys held at most; past it every key is dropped (their permits go unused; refused keys
    # cost a round trip again). A window's keys are of no use once it has ended.
    MAX_KEYS = 10_000

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def take(self, key: str, *, limit: int, batch: int, ttl: int) -> tuple[bool, bool]:
        """Whether one more request of ``key`` is let in, and whether this is the first refusal
        of ``key`` in this process. Raises ``RedisError`` when the cache does not answer."""
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.left:
                held.left -= 1
                return True, False
            if held is not None and held.spent:
                return False, False
        count = _count_hit(key, ttl=ttl, by=batch)  # a round trip, outside the lock
        granted = max(0, min(batch, limit - (count - batch)))
        with self._lock:
            if key not in self._held and len(self._held) >= self.MAX_KEYS:
                self._held.clear()
            held = self._held.setdefault(key, _Held())
            held.left += max(granted - 1, 0)
            first_refusal = granted == 0 and not held.spent
            held.spent = held.spent or granted < batch
        return granted > 0, first_refusal


_permits = _Permits()

_clients: dict[tuple[str, float], Redis] = {}
_clients_lock = threading.Lock()


def _primary(location: str | list[str]) -> str:
    """The server Django's RedisCache writes to: the first of its LOCATION."""
    servers = re.split("[;,]", location) if isinstance(location, str) else location
    return servers[0].strip()


def _redis_client(location: str | list[str]) -> Redis:
    """A client for the cache's primary server, built once per process, with the throttle's
    own socket timeout (``WEBHOOK_THROTTLE_TIMEOUT``).

    Not Django's: Django builds a new ``redis.Redis`` on every cache call, which on redis-py 8
    copies every response callback and costs more than the round trip itself, and the cache's
    socket timeout is too long to wait for a check that may be skipped."""
    server, timeout = _primary(location), settings.WEBHOOK_THROTTLE_TIMEOUT
    with _clients_lock:
        client = _clients.get((server, timeout))
        if client is None:
            client = _clients[(server, timeout)] = Redis.from_url(
                server,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                # One attempt, whatever redis-py's defaults (they changed in 6.0; a client
                # built from host and port retries a connect timeout 10 times, ~5 s here).
                retry=Retry(NoBackoff(), 0),
            )
    return client


def _count_hit(key: str, *, ttl: int, by: int = 1) -> int:
    """Add ``by`` to ``key`` in the default cache and return the new count, atomically."""
    cache = caches["default"]
    if isinstance(cache, RedisCache):
        # One round trip. Django's cache API needs three (add; incr, which checks EXISTS
        # first); a redis-py pipeline costs more to build than the round trip it saves.
        full_key = cache.make_key(key)  # the cache's KEY_PREFIX and version
        client = _redis_client(settings.CACHES["default"]["LOCATION"])
        try:
            count = client.evalsha(_HIT_SHA, 1, full_key, ttl, by)
        except NoScriptError:  # first use since Redis started: EVAL also caches the script
            count = client.eval(_HIT, 1, full_key, ttl, by)
        return int(count)
    cache.add(key, 0, timeout=ttl)  # any other backend (development with locmem)
    return int(cache.incr(key, by))


def webhook_throttle_wait(*, request: HttpRequest) -> int | None:
    """Whole seconds the sender should wait before retrying, or None to let the request in."""
    location = str(settings.CACHES["default"].get("LOCATION", ""))
    if time.monotonic() < _skip_until.get(location, 0.0):
        return None
    throttle = WebhookRateThrottle()
    try:
        allowed = throttle.allow_request(request, None)
    except RedisError as exc:
        with _skip_lock:
            _skip_until[location] = time.monotonic() + FAIL_OPEN_SECONDS
        logger.warning(
            "webhook throttle unavailable; letting requests through for %.0f s",
            FAIL_OPEN_SECONDS,
            extra={"error": repr(exc)},
        )
        return None
    if allowed:
        return None
    if throttle.first_refusal:
        # Once per address, window and process, not once per refused request of a flood.
        logger.warning(
            "webhook rate limit reached",
            extra={"throttle_key": throttle.key, "rate": throttle.rate},
        )
    return max(1, math.ceil(throttle.wait()))
