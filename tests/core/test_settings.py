"""Configuration: production refuses to start without secrets, passes check --deploy, and
Celery is configured for at-least-once delivery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from core.celery import app

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = {
    "DJANGO_DEBUG": "0",
    "DJANGO_SECRET_KEY": "k3y-" + "a1B2c3D4e5F6g7H8i9J0" * 3,
    "STRIPE_WEBHOOK_SECRET": "whsec_live_example",
    "DJANGO_ALLOWED_HOSTS": "billing.example.com",
}


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "STRIPE_"))}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**base, "DJANGO_SETTINGS_MODULE": "core.settings", **env},
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("missing", ["DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"])
def test_production_without_a_secret_stops_with_a_clear_message(missing: str) -> None:
    env = {k: v for k, v in PRODUCTION.items() if k != missing}
    result = manage("check", env=env)
    assert result.returncode != 0
    assert f"{missing} must be set when DJANGO_DEBUG is off" in result.stderr
    assert "Traceback" not in result.stderr


def test_production_configuration_passes_check_deploy() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION)
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_https_settings_can_be_turned_off_for_plain_http() -> None:
    code = (
        "from django.conf import settings as s; "
        "print(s.SECURE_SSL_REDIRECT, s.SESSION_COOKIE_SECURE, s.SECURE_HSTS_SECONDS)"
    )
    on = manage("shell", "--no-imports", "-c", code, env=PRODUCTION)
    off = manage(
        "shell", "--no-imports", "-c", code, env={**PRODUCTION, "DJANGO_SECURE_SSL_REDIRECT": "0"}
    )
    assert on.stdout.split() == ["True", "True", "31536000"]
    assert off.stdout.split() == ["False", "False", "0"]


def test_zero_tolerance_is_refused() -> None:
    result = manage("check", env={"STRIPE_WEBHOOK_TOLERANCE": "0"})
    assert result.returncode != 0
    assert "STRIPE_WEBHOOK_TOLERANCE must be a positive number" in result.stderr


def test_visibility_timeout_shorter_than_a_countdown_is_refused() -> None:
    result = manage("check", env={"CELERY_VISIBILITY_TIMEOUT": "60"})
    assert result.returncode != 0
    assert "CELERY_VISIBILITY_TIMEOUT must outlive" in result.stderr


def test_comma_separated_webhook_secrets_while_rolling() -> None:
    assert settings.STRIPE_WEBHOOK_SECRETS == ["whsec_test_primary", "whsec_test_rolled"]


def test_celery_is_configured_for_at_least_once_delivery() -> None:
    conf = app.conf
    assert conf.task_serializer == "json"
    assert conf.accept_content == ["json"]
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_time_limit
    assert conf.task_soft_time_limit
    assert [q.name for q in conf.task_queues] == ["default", "email"]  # never the dlq
    app.loader.import_default_modules()  # what a worker does at start
    email_task = app.tasks["invoicing.send_invoice_email"]
    longest_wait = settings.EMAIL_RETRY_BACKOFF_MAX + email_task.time_limit
    assert conf.broker_transport_options["visibility_timeout"] > longest_wait
    assert email_task.max_retries == 4  # five attempts in all
    assert email_task.acks_late
    assert email_task.reject_on_worker_lost


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("API_TOKEN_TTL_HOURS", "0", "API_TOKEN_TTL_HOURS must be at least 1"),
        ("ADMIN_LOGIN_FAILURE_LIMIT", "0", "ADMIN_LOGIN_FAILURE_LIMIT and"),
        ("ADMIN_LOGIN_COOLOFF_SECONDS", "0", "ADMIN_LOGIN_COOLOFF_SECONDS must be"),
        ("HEALTH_CACHE_SECONDS", "-1", "HEALTH_CACHE_SECONDS must be 0 or more"),
    ],
)
def test_security_settings_out_of_range_stop_start_up(name: str, value: str, message: str) -> None:
    result = manage("check", env={**PRODUCTION, name: value})
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
