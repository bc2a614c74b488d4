"""The system check that guards the timing the crash window's bound rests on, whichever
settings module set the values (tests and the chaos suite scale them)."""

from __future__ import annotations

from typing import Any

from django.core.checks import run_checks


def _errors() -> set[str]:
    return {message.id for message in run_checks() if message.id in {"core.E001", "core.E002"}}


def test_the_shipped_and_the_scaled_timing_pass() -> None:
    assert _errors() == set()


def test_a_lease_no_longer_than_the_email_task_is_an_error(settings: Any) -> None:
    settings.EMAIL_CLAIM_LEASE_SECONDS = settings.EMAIL_TASK_TIME_LIMIT
    assert _errors() == {"core.E001"}


def test_a_visibility_timeout_a_task_can_outlive_is_an_error(settings: Any) -> None:
    limit = max(settings.EMAIL_TASK_TIME_LIMIT, settings.CELERY_TASK_TIME_LIMIT)
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": limit}
    assert _errors() == {"core.E002"}
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {}  # RabbitMQ: no timeout to outlive
    assert _errors() == set()
