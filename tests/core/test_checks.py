"""The system checks: the project's, guarding the timing the crash window's bound rests on,
whichever settings module set the values (tests and the chaos suite scale them); and the
machinery's, which the project's settings pass and which name a setting that would weaken a
guarantee."""

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


def _machinery_messages() -> set[str]:
    return {m.id for m in run_checks() if m.id is not None and m.id.startswith("asyncwork.")}


def test_the_project_weakens_none_of_the_machinerys_guarantees() -> None:
    """The Celery block leaves late acknowledgement, requeue on a lost worker, one message
    reserved, Redis's queue order and RabbitMQ's confirms to ``asyncwork.install``, and TASKS
    names its backend: ``manage.py check`` has nothing to say of them."""
    assert _machinery_messages() == set()


def test_without_the_backend_in_tasks_the_check_says_tasks_would_run_inline(
    settings: Any,
) -> None:
    settings.TASKS = {"default": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"}}
    assert _machinery_messages() == {"asyncwork.W007"}


def test_a_celery_setting_that_weakens_a_guarantee_is_named(settings: Any) -> None:
    settings.CELERY_WORKER_PREFETCH_MULTIPLIER = 4
    settings.CELERY_TASK_ACKS_LATE = False
    assert _machinery_messages() == {"asyncwork.W001", "asyncwork.W002"}
