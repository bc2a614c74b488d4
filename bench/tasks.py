"""Celery tasks and signals that exist only for the benchmarks, loaded into a worker with
``celery -A core worker --include bench.tasks`` (the application's code is not touched).

* ``bench.noop``: the baseline task. It does nothing but add one to a counter in Redis, so the
  benchmark can tell when every task it published has run. Published to the ``default`` queue,
  which every ``celery -A core worker`` consumes.
* On ``worker_ready``, each worker sets ``<run prefix>bench:ready:<hostname>`` in Redis: the
  benchmark waits for one such key per worker it started, without parsing logs (the project's
  logging keeps Celery's "ready." line at INFO, below the benchmarks' ``LOG_LEVEL=WARNING``).

Both keys are in the application's Redis (``REDIS_URL``; the broker too, unless it is RabbitMQ)
under the run's key prefix (``CELERY_BROKER_KEY_PREFIX``), so the run's cleanup deletes them
with everything else.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

NOOP_TASK = "bench.noop"
NOOP_COUNTER = "bench:noop-done"  # after the broker prefix
READY_KEY = "bench:ready:"  # + worker hostname, after the broker prefix

_clients: dict[int, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One client per process (a prefork child must not reuse its parent's sockets)."""
    client = _clients.get(os.getpid())
    if client is None:
        client = _clients[os.getpid()] = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5
        )
    return client


def _prefix() -> str:
    # The run's own (bench.run.stack_env), whichever the broker: on RabbitMQ, where the
    # broker's transport options have no key prefix, the keys are still the run's.
    return os.environ.get("CELERY_BROKER_KEY_PREFIX", "")


@shared_task(name=NOOP_TASK, ignore_result=True)
def noop() -> None:
    """Count one completion; nothing else."""
    _redis().incr(_prefix() + NOOP_COUNTER)


@worker_ready.connect(weak=False, dispatch_uid="bench.tasks.ready")
def _ready(sender: Any = None, **_: Any) -> None:
    hostname = getattr(sender, "hostname", None) or "unknown"
    _redis().set(_prefix() + READY_KEY + hostname, str(os.getpid()), ex=3600)
