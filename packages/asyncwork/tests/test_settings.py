"""The machinery's settings: one ``ASYNCWORK`` dict, a default for every key, and system checks
whose messages name the key that is wrong."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from asyncwork.checks import asyncwork_settings_check
from asyncwork.settings import SETTINGS, asyncwork_settings, metric_name


def messages(settings: Any, **given: Any) -> list[tuple[str | None, str]]:
    settings.ASYNCWORK = given
    return [(error.id, error.msg) for error in asyncwork_settings_check()]


def test_without_the_setting_every_key_has_its_default(settings: Any) -> None:
    del settings.ASYNCWORK
    assert {key: getattr(asyncwork_settings, key) for key in SETTINGS} == {
        key: setting.default for key, setting in SETTINGS.items()
    }
    assert asyncwork_settings.METRIC_PREFIX == "asyncwork_"
    assert metric_name("dlq_depth") == "asyncwork_dlq_depth"
    assert asyncwork_settings_check() == []


def test_a_key_given_wins_and_the_rest_keep_their_defaults(settings: Any) -> None:
    settings.ASYNCWORK = {"DLQ_ALERT_THRESHOLD": 3}
    assert asyncwork_settings.DLQ_ALERT_THRESHOLD == 3
    assert SETTINGS["OUTBOX_STALE_SECONDS"].default == asyncwork_settings.OUTBOX_STALE_SECONDS
    with pytest.raises(AttributeError, match="no setting 'DLQ_ALERT'"):
        _ = asyncwork_settings.DLQ_ALERT


def test_an_unknown_key_is_named_with_the_one_meant(settings: Any) -> None:
    assert messages(settings, DLQ_ALERT_TRESHOLD=2) == [
        ("asyncwork.E002", "ASYNCWORK['DLQ_ALERT_TRESHOLD'] is not a setting of asyncwork.")
    ]
    settings.ASYNCWORK = {"DLQ_ALERT_TRESHOLD": 2}
    assert asyncwork_settings_check()[0].hint == "Did you mean 'DLQ_ALERT_THRESHOLD'?"


@pytest.mark.parametrize(
    ("key", "value", "must"),
    [
        ("DLQ_ALERT_THRESHOLD", 0, "a whole number, 1 or more"),
        ("BACKPRESSURE_HARD_MARK", "50000", "a whole number, 1 or more"),
        ("HEALTH_TIMEOUT_SECONDS", 0, "a number greater than 0"),
        ("OUTBOX_RELAY_GRACE_SECONDS", -1, "a number, 0 or more"),
        ("WORKER_METRICS_PORT", 70000, "a port number, 0 to 65535 (0: off)"),
        ("METRIC_PREFIX", None, "a string"),
        (
            "TRUSTED_PROXIES",
            ["10.0.0.2", "edge"],
            "a list of addresses or networks (like 10.0.0.2 or 10.0.0.0/24)",
        ),
        ("LOG_CONTEXT_FIELDS", ["event id"], "a list of field names (identifiers)"),
    ],
)
def test_a_value_the_machinery_cannot_use_is_named_with_what_it_must_be(
    settings: Any, key: str, value: Any, must: str
) -> None:
    assert messages(settings, **{key: value}) == [
        ("asyncwork.E003", f"ASYNCWORK[{key!r}] is {value!r}: it must be {must}.")
    ]


def test_marks_out_of_order_are_named(settings: Any) -> None:
    assert messages(settings, BACKPRESSURE_SOFT_MARK=100, BACKPRESSURE_HARD_MARK=10) == [
        (
            "asyncwork.E004",
            "ASYNCWORK['BACKPRESSURE_SOFT_MARK'] (100) must be at most "
            "ASYNCWORK['BACKPRESSURE_HARD_MARK'] (10).",
        )
    ]


def test_not_a_dict_is_named(settings: Any) -> None:
    settings.ASYNCWORK = [("DLQ_ALERT_THRESHOLD", 1)]
    assert [error.id for error in asyncwork_settings_check()] == ["asyncwork.E001"]


def test_the_test_projects_settings_pass(settings: Any) -> None:
    assert asyncwork_settings_check() == []


def test_manage_py_check_stops_on_a_wrong_key(settings: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "METRICS_TOKN": "x"}
    with pytest.raises(SystemCheckError, match=r"ASYNCWORK\['METRICS_TOKN'\] is not a setting"):
        call_command("check")


def test_a_default_token_lifetime_above_the_maximum_is_named(settings: Any) -> None:
    assert messages(settings, API_TOKEN_TTL_HOURS=49, API_TOKEN_MAX_HOURS=48) == [
        (
            "asyncwork.E008",
            "ASYNCWORK['API_TOKEN_TTL_HOURS'] (49) must be at most "
            "ASYNCWORK['API_TOKEN_MAX_HOURS'] (48): the default lifetime of a token is one it may "
            "have.",
        )
    ]


def test_the_admin_pages_without_djangos_admin_are_named() -> None:
    """``manage.py check`` of a project that installs the machinery's admin pages alone."""
    project = (
        "import django; from django.conf import settings; "
        "settings.configure(INSTALLED_APPS=["
        "'django.contrib.auth', 'django.contrib.contenttypes', 'asyncwork.contrib.admin']); "
        "django.setup(); from django.core.management import call_command; call_command('check')"
    )
    checked = subprocess.run(
        [sys.executable, "-c", project], capture_output=True, text=True, timeout=60, check=False
    )
    assert checked.returncode == 1
    assert "(asyncwork.E009) asyncwork.contrib.admin is installed without django.contrib.admin" in (
        checked.stderr
    )
