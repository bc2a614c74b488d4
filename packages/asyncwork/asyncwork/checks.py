"""System checks (registered by ``AsyncWorkConfig.ready``, run by ``manage.py check`` and
``migrate``): the ``ASYNCWORK`` setting, each message naming the key, what it holds and what it
must hold; any project setting that would weaken a guarantee, each with its own id; and, on the
databases a command names (``migrate``, ``check --database``), migrations applied partway through
a squashed migration whose replaced files are gone."""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

from asyncwork.broker import BACKEND, rabbitmq
from asyncwork.settings import SETTINGS, asyncwork_settings

_MUST = {
    "positive": "a number greater than 0",
    "non-negative": "a number, 0 or more",
    "count": "a whole number, 1 or more",
    "port": "a port number, 0 to 65535 (0: off)",
    "text": "a string",
    "flag": "True or False",
    "networks": "a list of addresses or networks (like 10.0.0.2 or 10.0.0.0/24)",
    "names": "a list of field names (identifiers)",
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _network(entry: Any) -> bool:
    if not isinstance(entry, str):
        return False
    try:
        ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return False
    return True


def _fits(kind: str, value: Any) -> bool:
    if kind == "positive":
        return _is_number(value) and value > 0
    if kind == "non-negative":
        return _is_number(value) and value >= 0
    if kind == "count":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == "port":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535
    if kind == "text":
        return isinstance(value, str)
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "networks":
        return isinstance(value, list | tuple) and all(_network(entry) for entry in value)
    return isinstance(value, list | tuple) and all(
        isinstance(name, str) and name.isidentifier() for name in value
    )


_ORDERED = [
    ("BACKPRESSURE_SOFT_MARK", "BACKPRESSURE_HARD_MARK", "asyncwork.E004", ""),
    (
        "API_TOKEN_TTL_HOURS",
        "API_TOKEN_MAX_HOURS",
        "asyncwork.E008",
        ": the default lifetime of a token is one it may have",
    ),
]


@register()
def asyncwork_settings_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    given = getattr(settings, "ASYNCWORK", {})
    if not isinstance(given, dict):
        return [Error("ASYNCWORK must be a dict of the machinery's settings.", id="asyncwork.E001")]
    errors: list[CheckMessage] = []
    for key in given:
        if key not in SETTINGS:
            close = difflib.get_close_matches(str(key), SETTINGS, n=1)
            errors.append(
                Error(
                    f"ASYNCWORK[{key!r}] is not a setting of asyncwork.",
                    hint=f"Did you mean {close[0]!r}?" if close else "See asyncwork/settings.py.",
                    id="asyncwork.E002",
                )
            )
    for key, setting in SETTINGS.items():
        value = given.get(key, setting.default)
        if not _fits(setting.kind, value):
            errors.append(
                Error(
                    f"ASYNCWORK[{key!r}] is {value!r}: it must be {_MUST[setting.kind]}.",
                    id="asyncwork.E003",
                )
            )
    # Pairs whose first may not exceed their second.
    for low, high, check_id, why in _ORDERED:
        values = [given.get(key, SETTINGS[key].default) for key in (low, high)]
        if all(_is_number(value) for value in values) and values[0] > values[1]:
            errors.append(
                Error(
                    f"ASYNCWORK[{low!r}] ({values[0]}) must be at most "
                    f"ASYNCWORK[{high!r}] ({values[1]}){why}.",
                    id=check_id,
                )
            )
    return errors


def settings_refusals() -> list[str]:
    """The errors of ``asyncwork_settings_check`` as lines: for a project that stops each process
    on them as it starts, before Django's apps load (``manage.py check`` says the same)."""
    return [str(error.msg) for error in asyncwork_settings_check()]


# Project settings that would weaken a guarantee, each with its own id: (setting, a test of the
# value the project gave, what it weakens).
WEAKENING: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "asyncwork.W001": (
        "CELERY_WORKER_PREFETCH_MULTIPLIER",
        lambda value: value != 1,
        "a worker reserves more than one message at a time: a worker that dies strands them "
        "until its heartbeat lapses",
    ),
    "asyncwork.W002": (
        "CELERY_TASK_ACKS_LATE",
        lambda value: value is False,
        "jobs are acknowledged before they run: one cut short is lost",
    ),
    "asyncwork.W003": (
        "CELERY_TASK_REJECT_ON_WORKER_LOST",
        lambda value: value is False,
        "a job whose worker was killed is acknowledged, not run again",
    ),
}


@register()
def guarantees_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about a project setting that weakens a guarantee; fail without PostgreSQL."""
    messages: list[CheckMessage] = []
    for check_id, (name, weakens, why) in WEAKENING.items():
        if hasattr(settings, name) and weakens(getattr(settings, name)):
            messages.append(Warning(f"{name} = {getattr(settings, name)!r}: {why}.", id=check_id))
    if float(asyncwork_settings.WORKER_HEARTBEAT_LAPSE_SECONDS) == 0:
        messages.append(
            Warning(
                "ASYNCWORK['WORKER_HEARTBEAT_LAPSE_SECONDS'] is 0: the job of a worker that died "
                "runs again only once its hard time limit has passed, not within seconds.",
                id="asyncwork.W004",
            )
        )
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {}
    if rabbitmq() and options.get("confirm_publish") is False:
        messages.append(
            Warning(
                "CELERY_BROKER_TRANSPORT_OPTIONS['confirm_publish'] is False: a job is marked "
                "published before RabbitMQ took it, so one it drops is never published again.",
                id="asyncwork.W005",
            )
        )
    if options.get("queue_order_strategy", "priority") != "priority" and not rabbitmq():
        messages.append(
            Warning(
                "CELERY_BROKER_TRANSPORT_OPTIONS['queue_order_strategy'] is not 'priority': a "
                "job published again (a retry, a rescue) waits behind the backlog.",
                id="asyncwork.W006",
            )
        )
    engine = settings.DATABASES.get("default", {}).get("ENGINE", "")
    if "postgresql" not in engine:
        messages.append(
            Error(
                f"DATABASES['default'] is {engine or 'not set'}: asyncwork needs PostgreSQL "
                "(its claims, relay and rescue rely on SKIP LOCKED, JSONB and advisory locks).",
                id="asyncwork.E005",
            )
        )
    return messages


def backend_check(backend: Any) -> list[CheckMessage]:
    """``OutboxBackend.check``, run by Django's task framework: a ``TASKS`` entry without
    ``QUEUES`` means every task uses ``default``, which is what a worker reads."""
    if not getattr(settings, "CELERY_BROKER_URL", None):
        return [
            Error(
                f"TASKS[{backend.alias!r}] is asyncwork's backend but CELERY_BROKER_URL is not "
                "set: nothing would publish its jobs.",
                id="asyncwork.E006",
            )
        ]
    return []


@register()
def tasks_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Without asyncwork's backend in ``TASKS``, django.tasks runs each task inline, in the
    request that enqueued it (its default, ``ImmediateBackend``)."""
    tasks = getattr(settings, "TASKS", None) or {}
    if BACKEND in [params.get("BACKEND") for params in tasks.values()]:
        return []
    return [
        Warning(
            "asyncwork is installed but no TASKS backend is asyncwork.backend.OutboxBackend: "
            "django.tasks runs every task inline, in the request, with none of its guarantees.",
            hint=f'TASKS = {{"default": {{"BACKEND": "{BACKEND}"}}}}',
            id="asyncwork.W007",
        )
    ]


# The release whose migration files lead a database from any earlier state to the squashed
# migrations of every app, which replace them.
BRIDGE_RELEASE = "de09092"


@register(Tags.database)
def migrations_partway_check(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Django runs a squashed migration where all or none of what it replaces is applied; where
    some is, it runs the rest from the replaced files, and where those are gone it leaves the
    app out of its plan without a word: ``migrate`` exits 0 and the schema stays behind. Such a
    database is refused here, before ``migrate`` changes anything."""
    loader = MigrationLoader(None, load=False)
    loader.load_disk()
    errors: list[CheckMessage] = []
    for alias in databases or ():
        applied = set(MigrationRecorder(connections[alias]).applied_migrations())
        for (app, name), migration in sorted(loader.disk_migrations.items()):
            replaced = set(migration.replaces)
            done = replaced & applied
            gone = sorted(replaced - applied - set(loader.disk_migrations))
            if not done or not gone:
                continue
            errors.append(
                Error(
                    f"The {alias!r} database applied {len(done)} of the {len(replaced)} "
                    f"migrations {app}.{name} replaces; the files of the others "
                    f"({', '.join(f'{a}.{n}' for a, n in gone)}) are gone, so migrate would "
                    f"skip {app} and leave its tables behind.",
                    hint=f"Migrate this database with the previous release first (commit "
                    f"{BRIDGE_RELEASE}, whose migration files lead to this one), then with this "
                    f"release. CHANGELOG.md: Upgrading a database migrated before one migration "
                    f"per app.",
                    id="asyncwork.E007",
                )
            )
    return errors
