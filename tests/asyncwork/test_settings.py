"""This application's settings against the machinery's checks: its ``ASYNCWORK`` passes and keeps
the metric names the application always had; the distribution's README lists every setting (the
``ASYNCWORK`` checks themselves: packages/asyncwork/tests/test_settings.py). Each check of a
project setting that would weaken a guarantee (``asyncwork.checks``: W001-W007, E005, E006)
fires on the value that weakens it, through Django's own ``run_checks`` (what ``manage.py
check`` and ``migrate`` run), and stays quiet on this project's settings and on the value that
keeps the guarantee."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from django.core.checks import run_checks

from asyncwork.checks import asyncwork_settings_check
from asyncwork.settings import metric_name, settings_table
from stack.process import ROOT

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/checks"
REDIS_URL = "redis://127.0.0.1:6379/15"


def broker_use(settings: Any, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """The project's broker is ``url``: its setting, and the environment variable the Celery app
    reads first (``asyncwork.broker.rabbitmq`` asks the app)."""
    settings.CELERY_BROKER_URL = url
    monkeypatch.setenv("CELERY_BROKER_URL", url)


def asyncwork_ids() -> list[str]:
    """The ids of the machinery's messages among every check Django runs."""
    return sorted(
        str(message.id) for message in run_checks() if str(message.id).startswith("asyncwork.")
    )


def test_this_applications_settings_pass_and_keep_its_metric_names(settings: Any) -> None:
    assert asyncwork_settings_check() == []
    assert asyncwork_ids() == []
    assert metric_name("dlq_depth") == "invoicing_dlq_depth"


def test_the_distributions_readme_lists_every_setting_with_its_default() -> None:
    readme = (ROOT / "packages" / "asyncwork" / "README.md").read_text()
    block = readme.split("checks it -->\n", 1)[1].split("\n<!-- end settings -->", 1)[0]
    assert block == settings_table()


# A Celery setting of the project's (in Django's settings): the check that names it, a value that
# weakens its guarantee, and values that keep it.
CELERY_SETTINGS = [
    ("asyncwork.W001", "CELERY_WORKER_PREFETCH_MULTIPLIER", 4, [1]),
    ("asyncwork.W001", "CELERY_WORKER_PREFETCH_MULTIPLIER", 0, [1]),  # 0: Celery's "no limit"
    ("asyncwork.W002", "CELERY_TASK_ACKS_LATE", False, [True]),
    ("asyncwork.W003", "CELERY_TASK_REJECT_ON_WORKER_LOST", False, [True]),
]


@pytest.mark.parametrize(("check_id", "name", "weakening", "keeping"), CELERY_SETTINGS)
def test_a_celery_setting_that_weakens_a_guarantee_is_named(
    settings: Any, check_id: str, name: str, weakening: Any, keeping: list[Any]
) -> None:
    assert not hasattr(settings, name)  # the project leaves it to asyncwork.install
    setattr(settings, name, weakening)
    warnings = [message for message in run_checks() if message.id == check_id]
    assert len(warnings) == 1
    assert warnings[0].msg.startswith(f"{name} = {weakening!r}: ")
    assert asyncwork_ids() == [check_id]
    for value in keeping:
        setattr(settings, name, value)
        assert asyncwork_ids() == []


def test_no_rescue_by_heartbeat_is_named(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": 0}
    assert asyncwork_ids() == ["asyncwork.W004"]
    settings.ASYNCWORK = {**settings.ASYNCWORK, "WORKER_HEARTBEAT_LAPSE_SECONDS": 0.5}
    assert asyncwork_ids() == []


@pytest.mark.parametrize(
    ("url", "confirm_publish", "expected"),
    [
        (RABBITMQ_URL, False, ["asyncwork.W005"]),
        (RABBITMQ_URL, True, []),
        (RABBITMQ_URL, None, []),  # not given: asyncwork.install turns it on
        (REDIS_URL, False, []),  # Redis has no publisher confirms
    ],
)
def test_rabbitmqs_publisher_confirms_turned_off_are_named(
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    confirm_publish: bool | None,
    expected: list[str],
) -> None:
    broker_use(settings, monkeypatch, url)
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = (
        {} if confirm_publish is None else {"confirm_publish": confirm_publish}
    )
    assert asyncwork_ids() == expected


@pytest.mark.parametrize(
    ("url", "strategy", "expected"),
    [
        (REDIS_URL, "round_robin", ["asyncwork.W006"]),
        (REDIS_URL, "sorted", ["asyncwork.W006"]),
        (REDIS_URL, "priority", []),
        (REDIS_URL, None, []),  # not given: asyncwork.install sets priority
        (RABBITMQ_URL, "round_robin", []),  # RabbitMQ reads no queue first
    ],
)
def test_redis_queues_read_in_another_order_are_named(
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    strategy: str | None,
    expected: list[str],
) -> None:
    broker_use(settings, monkeypatch, url)
    options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS}
    options.pop("queue_order_strategy", None)
    if strategy is not None:
        options["queue_order_strategy"] = strategy
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    assert asyncwork_ids() == expected


def test_a_tasks_setting_without_the_backend_is_named(settings: Any) -> None:
    """django.tasks' default backend runs a task inline, in the request."""
    settings.TASKS = {"default": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"}}
    assert asyncwork_ids() == ["asyncwork.W007"]
    del settings.TASKS
    assert asyncwork_ids() == ["asyncwork.W007"]
    settings.TASKS = {
        "inline": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"},
        "default": {"BACKEND": "asyncwork.backend.OutboxBackend"},
    }
    assert asyncwork_ids() == []


def test_the_backend_without_a_broker_is_named(settings: Any) -> None:
    del settings.CELERY_BROKER_URL
    messages = [message for message in run_checks() if message.id == "asyncwork.E006"]
    assert [message.msg for message in messages] == [
        "TASKS['default'] is asyncwork's backend but CELERY_BROKER_URL is not set: nothing "
        "would publish its jobs."
    ]
    settings.CELERY_BROKER_URL = ""
    assert asyncwork_ids() == ["asyncwork.E006"]
    settings.CELERY_BROKER_URL = REDIS_URL
    assert asyncwork_ids() == []


def manage_py_check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_manage_py_check_stops_on_a_database_other_than_postgresql(tmp_path: Any) -> None:
    refused = manage_py_check(DATABASE_URL=f"sqlite:///{tmp_path / 'jobs.sqlite3'}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert (
        "(asyncwork.E005) DATABASES['default'] is django.db.backends.sqlite3: asyncwork needs "
        "PostgreSQL" in refused.stderr
    )
    passed = manage_py_check()
    assert passed.returncode == 0, passed.stderr
    assert "System check identified no issues" in passed.stdout
