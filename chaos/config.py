"""The two profiles (the full run and the CI run), the two arms, and the application's
environment for a chaos run.

Timing is scaled down so a run takes minutes (chaos/settings.py), keeping the relations
core/settings.py names (visibility > the tasks' hard time limits; claim lease > the email task's
hard limit), and the beat's one frequent job, the dead-letter alert, runs every 5 s in the chaos
database after ``setup_periodic_tasks`` (data, not code), so that the beats have dispatches to
compare across hosts. The safety nets are the workers' own (each worker's poll: relay, rescue,
republish of what the broker lost): no periodic task holds any of them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from chaos.faults import (
    BEAT_HOST_CUT,
    BROKER_STALL,
    DATA_FLAP,
    POSTGRES_RESTART,
    REDIS_RESTART,
    RELAY_KILL,
    WEB_BROKER_CUT,
    WORKER_DB_CUT,
    WORKER_HOST_CUT,
    WORKER_KILL,
    Step,
)
from stack.process import ROOT
from stack.smtp import IN_WINDOW, OUTSIDE, Faults

SAFE = "safe"
CONTROL = "control"

# Scaled-down timing, the same in both arms: Django settings (chaos/settings.py)...
TIMING = {
    "EMAIL_CLAIM_LEASE_SECONDS": 30,
    # The email task's soft limit; a run is killed 15 s later (asyncwork.backend's
    # TIME_LIMIT_GRACE), which is its hard limit.
    "EMAIL_TASK_SOFT_TIME_LIMIT": 8,
    "EMAIL_TASK_TIME_LIMIT": 23,
    "CELERY_TASK_TIME_LIMIT": 20,
    "CELERY_TASK_SOFT_TIME_LIMIT": 15,
}
# Redis's visibility timeout (CELERY_BROKER_TRANSPORT_OPTIONS, chaos/settings.py).
VISIBILITY_TIMEOUT = 30
# A running job's lease: its hard time limit plus asyncwork.runner's LEASE_MARGIN_SECONDS (30).
# The rescue by lease takes back a job whose owner's heartbeat it could not judge after this.
JOB_LEASE_SECONDS = TIMING["EMAIL_TASK_TIME_LIMIT"] + 30
# ...the machinery's (ASYNCWORK)...
TIMING_ASYNCWORK = {"OUTBOX_RELAY_GRACE_SECONDS": 2}
# ...and operator settings (the environment).
TIMING_ENV = {
    "EMAIL_RETRY_BACKOFF_BASE": "1",
    "EMAIL_RETRY_BACKOFF_MAX": "4",
    # A deferral waits up to twice this: 2 x 5 + 10 < 30, the visibility timeout.
    "EMAIL_BREAKER_RESET_SECONDS": "5",
}
# kombu's restore sweep for unacknowledged messages (core.settings, not configurable).
RESTORE_INTERVAL = 10

# Beat intervals (seconds) written into the chaos database, the same in both arms.
INTERVALS = {"dlq-alert": 5}


@dataclass(frozen=True)
class Profile:
    name: str
    invoices: int
    control_invoices: int
    rate: float  # deliveries per second, all senders together
    steps: tuple[Step, ...]
    quiesce_timeout: float  # seconds after the last fault
    senders: int = 16
    workers: int = 2
    concurrency: int = 2
    web_workers: int = 4
    fault_gap: float = 3.0  # seconds between one fault's end and the next's start
    hosts: bool = (
        False  # each role on a host of its own (chaos.hosts): workers, web_workers per host
    )
    # Seconds within which the work each worker kill, broker restart and PostgreSQL restart
    # hit must be done: a goal; None: reported only.
    recovery_bound: float | None = None


# The broker stall comes last: a Redis restart after it re-establishes every connection,
# which would hide what the stall alone leaves behind (workers that no longer fetch). Each
# bounded fault is followed by 30 s without another (chaos.faults.FaultRunner); the load (4,500
# invoices, about 300 s) carries every fault, the stall included, so that emails are there to
# flow after it; the last kill comes as it ends. Its rate, 30 deliveries (15 paid invoices) a
# second, is one the pipeline drains on this machine under the fault mix, so a backlog at a
# fault is that fault's: above it the queue grows throughout the load and a restart's recovery
# measures the drain of the backlog instead.
FULL = Profile(
    name="full",
    invoices=4500,
    control_invoices=4500,
    rate=30,
    workers=3,
    concurrency=3,
    quiesce_timeout=600,
    recovery_bound=30.0,
    steps=(
        Step(0.06, WORKER_KILL, window=IN_WINDOW),
        Step(0.14, WORKER_KILL, window=OUTSIDE),
        Step(0.22, RELAY_KILL),
        Step(0.30, WORKER_KILL, window=IN_WINDOW),
        Step(0.40, REDIS_RESTART),
        Step(0.52, POSTGRES_RESTART),
        Step(0.60, WORKER_KILL, window=OUTSIDE),
        Step(0.68, RELAY_KILL),
        Step(0.76, WORKER_KILL, window=IN_WINDOW),
        Step(0.88, BROKER_STALL, seconds=10),
        Step(1.0, WORKER_KILL, window=IN_WINDOW),
    ),
)

# The CI profile: one of each of the three faults the issue names for it. Its Redis restart
# comes as soon as the stall ends and drops the backlog the stall left, which the relay
# publishes then (a few seconds later the control arm's workers may have drained it, and the
# control arm could lose nothing); so the profile does not show what a stall alone leaves
# behind: BROKER_STALL does. The kill's recovery spans the stall and the restart: it is
# reported, and bounded in the full profile only.
SHORT = Profile(
    name="short",
    invoices=200,
    # As many as the safe arm: with 100, once the pipeline got faster the control arm had
    # drained its queue before the Redis restart and lost nothing (a CI run at 8148be4).
    control_invoices=200,
    rate=15,
    quiesce_timeout=240,
    steps=(
        Step(0.2, WORKER_KILL, window=IN_WINDOW),
        Step(0.4, BROKER_STALL, seconds=10),
        Step(0.7, REDIS_RESTART, after=0.0),
    ),
)

# The broker stall and nothing else.
BROKER_STALL_ONLY = Profile(
    name="broker-stall",
    invoices=300,
    control_invoices=300,
    rate=15,
    quiesce_timeout=300,
    steps=(Step(0.3, BROKER_STALL, seconds=10),),
)


# Across hosts (chaos.hosts): one worker on each of three hosts, gunicorn on each of two, two
# beats. Every partition but the beat's comes while the load runs, so that it cuts work in
# flight: the web host's (what it commits is not published); the worker host's cut from
# PostgreSQL, longer than the claim lease (30 s); the worker host's cut from everything,
# longer than the lease and Redis's visibility timeout (30 s); the data host's flapping. The
# beat host's cut, after the load, lasts longer than the standby's bound (its 5 s poll, plus
# about 20 s for PostgreSQL to drop the leader's session).
def _hosts_steps(flap_seconds: float) -> tuple[Step, ...]:
    return (
        Step(0.04, WEB_BROKER_CUT, seconds=10),
        Step(0.14, WORKER_DB_CUT, seconds=35),
        Step(0.33, WORKER_HOST_CUT, seconds=40),
        Step(0.7, DATA_FLAP, seconds=flap_seconds),
        Step(1.0, BEAT_HOST_CUT, seconds=35),
    )


HOSTS = Profile(
    name="hosts",
    invoices=1200,
    control_invoices=1200,
    rate=10,
    workers=3,
    concurrency=2,
    web_workers=2,
    quiesce_timeout=600,
    hosts=True,
    steps=_hosts_steps(60),
)
HOSTS_SHORT = Profile(
    name="hosts-short",
    invoices=600,
    control_invoices=600,
    rate=10,
    workers=3,
    concurrency=2,
    web_workers=2,
    quiesce_timeout=400,
    hosts=True,
    steps=_hosts_steps(20),
)

PROFILES = {p.name: p for p in (FULL, SHORT, BROKER_STALL_ONLY, HOSTS, HOSTS_SHORT)}


def app_env(
    *, smtp_port: int, smtp_host: str = "127.0.0.1", web_hosts: tuple[str, ...] = ("127.0.0.1",)
) -> dict[str, str]:
    """Everything the application's processes see, from a clean environment: production
    settings (DEBUG off, fresh secrets) on loopback (or the hosts' addresses given), and the
    scaled-down timing. The database and broker addresses are added by
    ``chaos.stack.Stack.env``."""
    inherited = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return {
        **inherited,
        "PYTHONUNBUFFERED": "1",
        # The machinery of this checkout (an ablation's worktree: patched), ahead of the one
        # the virtualenv has installed.
        "PYTHONPATH": str(ROOT / "packages" / "asyncwork"),
        "DJANGO_SETTINGS_MODULE": "chaos.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "STRIPE_WEBHOOK_SECRET": "whsec_" + secrets.token_hex(24),
        # The load signs test-mode events (stack/stripe_events.py); production acts on live only.
        "STRIPE_LIVEMODE": "test",
        "DJANGO_SECURE_SSL_REDIRECT": "0",
        "DJANGO_ALLOWED_HOSTS": ",".join(web_hosts),
        "LOG_LEVEL": "WARNING",
        "EMAIL_HOST": smtp_host,
        "EMAIL_PORT": str(smtp_port),
        **TIMING_ENV,
    }


def smtp_faults() -> Faults:
    """The SMTP server's faults throughout a run, the same in both arms:

    * every recipient in the refused domain is refused with 550 at RCPT: a permanent refusal,
      which the application must dead-letter, never retry;
    * about 20 % of DATA attempts are deferred (451), a given Message-ID at most twice: a
      transient fault that clears, as greylisting and a full spool do. (Uncapped and
      independent, 20 % deferrals would exhaust five attempts for one invoice in 3,125 by
      arithmetic alone; that measures the retry budget, not resilience to faults, and the
      kills and restarts spend attempts too);
    * about 10 % of replies to DATA come 1 to 4 s late (other sessions carry on).
    """
    return Faults(
        refuse_domain="refused.example.com",
        defer_rate=0.2,
        max_deferrals=2,
        delay=1.0,
        delay_max=4.0,
        delay_share=0.1,
    )


def worker_settings(arm: str) -> str:
    return "chaos.settings" if arm == SAFE else "chaos.unsafe_settings"


def worker_app(arm: str) -> str:
    """The workers' Celery app: the project's, or in the control arm one whose poll only relays
    (``chaos.unsafe_celery``)."""
    return "core" if arm == SAFE else "chaos.unsafe_celery"
