"""The machinery's settings: one ``ASYNCWORK`` dict in the project's settings, every key with a
default here. ``asyncwork_settings.KEY`` reads the project's value, else the default, at each
use (so ``override_settings(ASYNCWORK=...)`` takes effect at once). ``METRIC_PREFIX`` and
``LOG_CONTEXT_FIELDS`` are set once: counters take their names, and the logging module its
fields, as they load. The system checks (``asyncwork.checks``, run by ``manage.py check`` and
``migrate``) name a key that is unknown or holds a value the machinery cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings


@dataclass(frozen=True)
class Setting:
    default: Any
    # What a value must be: "positive" (a number > 0), "non-negative", "count" (an int >= 1),
    # "port" (0 to 65535), "text", "flag", "networks" (addresses or networks), "names".
    kind: str
    doc: str


SETTINGS: dict[str, Setting] = {
    "API_TOKEN_MAX_HOURS": Setting(
        2160, "count", "hours no API token may outlive (asyncwork.contrib.operators)"
    ),
    "API_TOKEN_TTL_HOURS": Setting(
        24, "count", "hours an API token lives unless `api_token create --hours` says"
    ),
    "BACKPRESSURE_SOFT_MARK": Setting(
        5000, "count", "backlog at which work marked sheddable is refused (503)"
    ),
    "BACKPRESSURE_HARD_MARK": Setting(
        50000, "count", "backlog at which all work behind backpressure is refused (503)"
    ),
    "BACKPRESSURE_CHECK_SECONDS": Setting(
        1.0, "non-negative", "seconds a process reuses its last measurement of the backlog"
    ),
    "BROKER_DELIVERY_LIMIT": Setting(
        10, "count", "RabbitMQ: deliveries of one message before it is dead-lettered as poison"
    ),
    "BULK_STATEMENT_TIMEOUT_SECONDS": Setting(
        10.0,
        "positive",
        "seconds one SQL statement of a bulk dead-letter request (API, admin) may take; keep "
        "it well under the web server's request timeout",
    ),
    "DLQ_ALERT_THRESHOLD": Setting(
        1, "count", "waiting dead letters that raise the alert (ERROR line, mail_admins)"
    ),
    "HEALTH_CACHE_SECONDS": Setting(
        1.0,
        "non-negative",
        "seconds a process reuses its last /health/ report for anonymous callers",
    ),
    "HEALTH_TIMEOUT_SECONDS": Setting(
        2.0, "positive", "seconds /health/ waits for all its checks together"
    ),
    "LOG_CONTEXT_FIELDS": Setting(
        (), "names", "fields a log context carries onto every record and across the broker"
    ),
    "METRIC_PREFIX": Setting("asyncwork_", "text", "the start of every metric's name"),
    "METRICS_ALLOWED_NETWORKS": Setting(
        ["127.0.0.0/8", "::1/128"],
        "networks",
        "without a token, the clients that may read /metrics",
    ),
    "METRICS_TOKEN": Setting(
        "", "text", "when set, /metrics and /health/'s details need Authorization: Bearer it"
    ),
    "OPERATOR_APPS": Setting(
        ["asyncwork", "operators"],
        "names",
        "the apps whose models the viewers and operators groups see (`manage.py setup_groups`)",
    ),
    "OUTBOX_PUBLISH_TIMEOUT": Setting(
        0.5, "positive", "seconds a publish may wait on the broker before the relay takes the row"
    ),
    "OUTBOX_RELAY_GRACE_SECONDS": Setting(
        10, "non-negative", "rows younger than this are left to their on-commit publish"
    ),
    "OUTBOX_STALE_SECONDS": Setting(
        300, "positive", "an unpublished outbox row older than this fails /health/"
    ),
    "PROBE_TIMEOUT_SECONDS": Setting(
        0.5, "positive", "seconds one probe may wait on Redis, the broker or a SQL statement"
    ),
    "REDIS_URL": Setting(
        "redis://127.0.0.1:6379/1",
        "text",
        "the Redis holding the circuit breakers' state (apart from a broker's database 0)",
    ),
    "REPUBLISH_UNSTARTED_SECONDS": Setting(
        600,
        "positive",
        "a job published this long ago and never started is published again (its message lost)",
    ),
    "TRUSTED_PROXIES": Setting(
        [], "networks", "peers whose X-Forwarded-For counts (asyncwork.contrib.http); empty: none"
    ),
    "WORKER_HEARTBEAT_SECONDS": Setting(
        2.0, "positive", "how often each task-running process writes its heartbeat row"
    ),
    "WORKER_HEARTBEAT_LAPSE_SECONDS": Setting(
        6.0,
        "non-negative",
        "a claim whose owner wrote no heartbeat for this long is taken over; 0: the lease alone",
    ),
    "WORKER_METRICS_ADDR": Setting("127.0.0.1", "text", "the interface of WORKER_METRICS_PORT"),
    "WORKER_METRICS_PORT": Setting(
        0, "port", "where a Celery worker serves its counters; 0: not served"
    ),
}


class AsyncWorkSettings:
    def __getattr__(self, name: str) -> Any:
        if name not in SETTINGS:
            raise AttributeError(f"ASYNCWORK has no setting {name!r}")
        given = getattr(settings, "ASYNCWORK", None) or {}
        return given[name] if name in given else SETTINGS[name].default


asyncwork_settings = AsyncWorkSettings()


def metric_name(name: str) -> str:
    """``name`` after the ``METRIC_PREFIX`` setting; a counter's name is fixed when it is made, as
    its module loads."""
    return f"{asyncwork_settings.METRIC_PREFIX}{name}"


def settings_table() -> str:
    """The settings as the Markdown table of the distribution's README."""
    rows = [f"| `{key}` | `{s.default!r}` | {s.doc} |" for key, s in SETTINGS.items()]
    return "\n".join(["| Key | Default | What it is |", "|---|---|---|", *rows])
