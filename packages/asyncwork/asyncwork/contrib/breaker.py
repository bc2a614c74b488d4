"""A circuit breaker shared by every worker, its state in Redis; every transition one Lua script.

* ``threshold`` consecutive failures from any process open it; the caller decides what a failure
  is.
* Open, callers are denied with the seconds left of ``reset_seconds`` (on Redis's clock). Then
  exactly one caller gets the probe (``SET NX`` on a token expiring after ``probe_ttl_seconds``,
  longer than the hard time limit; ``release_probe`` gives back an unused one). A success closes
  it; the probe's failure re-opens it.
* ``check_seconds``: a process that read it closed with no failure trusts that for so long,
  telling Redis no success; a failure is told at once. So an opening elsewhere is seen up to
  ``check_seconds`` late.
* Redis is not the outage: short socket timeouts, one retry; unreachable, ``allow()`` says closed
  and a warning is logged at most every ``_WARN_EVERY`` seconds.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

# Seconds per socket operation on the breaker's Redis: a stalled Redis costs a caller about 1.2 s
# (connect + read, two tries) before the breaker steps aside.
SOCKET_TIMEOUT = 0.3
_WARN_EVERY = 30.0

# allow(): KEYS = state hash, probe token; ARGV = reset seconds, token, probe ttl (ms).
# Closed: the consecutive failures so far come back with the verdict.
_ALLOW = """
local opened = redis.call('HGET', KEYS[1], 'opened_at')
if not opened then return {'allowed', redis.call('HGET', KEYS[1], 'failures') or '0'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local remaining = tonumber(opened) + tonumber(ARGV[1]) - now
if remaining > 0 then return {'denied', tostring(remaining)} end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then return {'probe', '0'} end
-- the probe is out: by one cool-down from now it has closed the breaker or re-opened it
return {'denied', ARGV[1]}
"""

# record_failure(): KEYS = state hash, probe token; ARGV = threshold, reset seconds.
_FAILURE = """
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local opened = redis.call('HGET', KEYS[1], 'opened_at')
if opened then
  if tonumber(opened) + tonumber(ARGV[2]) <= now then
    redis.call('HSET', KEYS[1], 'opened_at', tostring(now))
    redis.call('DEL', KEYS[2])
    return {'reopened', failures}
  end
  return {'open', failures}
end
if failures >= tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'opened_at', tostring(now))
  return {'opened', failures}
end
return {'closed', failures}
"""

# record_success(): KEYS = state hash, probe token. Returns opened_at if it was open.
_SUCCESS = """
local opened = redis.call('HGET', KEYS[1], 'opened_at')
redis.call('DEL', KEYS[1], KEYS[2])
return opened
"""

# release_probe(): KEYS = probe token; ARGV = token. Only the holder's own token is deleted.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Verdict(enum.StrEnum):
    ALLOWED = "allowed"  # closed: call the provider
    PROBE = "probe"  # half-open: this caller is the one probe
    DENIED = "denied"  # open, or half-open with the probe taken: do not call


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    retry_in: float = 0.0  # denied: seconds until asking again can be allowed
    token: str | None = None  # probe: the token to give back with release_probe()

    @property
    def allowed(self) -> bool:
        return self.verdict is not Verdict.DENIED

    @property
    def probe(self) -> bool:
        return self.verdict is Verdict.PROBE


_ALLOWED = Decision(Verdict.ALLOWED)

# Per breaker key: until when (time.monotonic()) this process trusts "closed, no failure".
_closed_until: dict[str, float] = {}


@functools.lru_cache(maxsize=8)
def _client(url: str) -> redis.Redis:
    # One pool per URL and process (redis-py resets it after a fork). One immediate retry covers a
    # pooled connection a Redis restart closed, without multiplying the timeout.
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_TIMEOUT,
        retry=Retry(NoBackoff(), 1),
    )


@functools.lru_cache(maxsize=32)
def _script(url: str, source: str) -> Script:
    # EVALSHA, falling back to EVAL once per Redis (after a restart, or the first time).
    return _client(url).register_script(source)


_warn_lock = threading.Lock()
_last_warning: dict[str, float] = {}


def _warn_unavailable(name: str, action: str, exc: Exception) -> None:
    with _warn_lock:
        now = time.monotonic()
        if now - _last_warning.get(name, -_WARN_EVERY) < _WARN_EVERY:
            return
        _last_warning[name] = now
    logger.warning(
        "circuit breaker %r: Redis unavailable during %s (%r); treating it as closed",
        name,
        action,
        exc,
        extra={"breaker": name},
    )


class Breaker:
    """Breaker ``name``, shared by every process on one Redis and key prefix: build one per call."""

    def __init__(
        self,
        name: str,
        *,
        threshold: int,
        reset_seconds: float,
        probe_ttl_seconds: float,
        url: str | None = None,
        check_seconds: float = 0.0,
    ) -> None:
        if threshold < 1 or reset_seconds <= 0 or probe_ttl_seconds <= 0:
            raise ValueError("threshold, reset_seconds and probe_ttl_seconds must be positive")
        self.name = name
        self.check_seconds = float(check_seconds)
        self.threshold = threshold
        self.reset_seconds = float(reset_seconds)
        self.probe_ttl_ms = int(probe_ttl_seconds * 1000)
        self.url = url or asyncwork_settings.REDIS_URL
        prefix = settings.CACHES["default"].get("KEY_PREFIX", "")
        self.key = f"{prefix}:breaker:{name}" if prefix else f"breaker:{name}"
        self.probe_key = f"{self.key}:probe"

    def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return _script(self.url, script)(keys=keys, args=args)

    def _trusted_closed(self) -> bool:
        """Within the window of a read that found it closed with no failure."""
        return self.check_seconds > 0 and time.monotonic() < _closed_until.get(self.key, 0.0)

    def _closed_seen(self) -> None:
        if self.check_seconds > 0:
            _closed_until[self.key] = time.monotonic() + self.check_seconds

    def allow(self) -> Decision:
        """May the caller call the provider now? Never raises."""
        if self._trusted_closed():
            return _ALLOWED
        token = uuid.uuid4().hex
        try:
            verdict, value = self._eval(
                _ALLOW, [self.key, self.probe_key], [self.reset_seconds, token, self.probe_ttl_ms]
            )
        except redis.RedisError as exc:
            _warn_unavailable(self.name, "allow", exc)
            return _ALLOWED
        verdict = Verdict(verdict.decode())
        if verdict is Verdict.PROBE:
            logger.info("circuit breaker %r half-open: probing", self.name)
            return Decision(Verdict.PROBE, token=token)
        if verdict is Verdict.DENIED:
            return Decision(Verdict.DENIED, retry_in=max(0.0, float(value)))
        if int(value) == 0:
            self._closed_seen()
        return _ALLOWED

    def record_failure(self) -> None:
        """One more consecutive failure of the provider. Never raises."""
        _closed_until.pop(self.key, None)
        try:
            outcome, failures = self._eval(
                _FAILURE, [self.key, self.probe_key], [self.threshold, self.reset_seconds]
            )
        except redis.RedisError as exc:
            _warn_unavailable(self.name, "record_failure", exc)
            return
        outcome = outcome.decode()
        if outcome == "opened":
            logger.warning(
                "circuit breaker %r opened after %d consecutive failures; cool-down %.0f s",
                self.name,
                failures,
                self.reset_seconds,
                extra={"breaker": self.name, "failures": failures},
            )
        elif outcome == "reopened":
            logger.warning(
                "circuit breaker %r probe failed; open for another %.0f s",
                self.name,
                self.reset_seconds,
                extra={"breaker": self.name, "failures": failures},
            )

    def record_success(self) -> None:
        """The provider answered: close the breaker and reset the count. Never raises."""
        if self._trusted_closed():
            return  # closed with no failure at this window's read: nothing to reset
        try:
            opened = self._eval(_SUCCESS, [self.key, self.probe_key], [])
        except redis.RedisError as exc:
            _warn_unavailable(self.name, "record_success", exc)
            return
        self._closed_seen()
        if opened is not None:
            logger.info("circuit breaker %r closed", self.name, extra={"breaker": self.name})

    def release_probe(self, decision: Decision) -> None:
        """Give back a probe that never called the provider; a no-op once it recorded an outcome."""
        if decision.token is None:
            return
        try:
            self._eval(_RELEASE, [self.probe_key], [decision.token])
        except redis.RedisError as exc:  # the token expires by itself
            _warn_unavailable(self.name, "release_probe", exc)

    def reset(self) -> None:
        """Force the breaker closed (an operator who knows the provider is back)."""
        _closed_until.pop(self.key, None)
        try:
            _client(self.url).delete(self.key, self.probe_key)
        except redis.RedisError as exc:
            _warn_unavailable(self.name, "reset", exc)

    def state(self) -> dict[str, Any]:
        """``state``: closed, open, half-open, or unknown when Redis does not answer."""
        state, failures, opened_at, retry_in, probing = "unknown", None, None, 0.0, False
        try:
            with _client(self.url).pipeline(transaction=True) as pipe:
                pipe.hgetall(self.key)
                pipe.exists(self.probe_key)
                pipe.time()
                fields, probing, (seconds, micros) = pipe.execute()
        except redis.RedisError as exc:
            _warn_unavailable(self.name, "state", exc)
        else:
            failures = int(fields.get(b"failures", 0))
            opened_at = float(fields[b"opened_at"]) if b"opened_at" in fields else None
            if opened_at is None:
                state = "closed"
            else:
                retry_in = max(0.0, opened_at + self.reset_seconds - (seconds + micros / 1e6))
                state = "open" if retry_in > 0 else "half-open"
        return {
            "name": self.name,
            "state": state,
            "failures": failures,
            "opened_at": opened_at,
            "retry_in": retry_in,
            "probing": bool(probing),
        }
