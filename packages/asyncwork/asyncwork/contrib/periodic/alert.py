"""The dead-letter alert: an ERROR line and a mail to ``ADMINS`` when the dead letters waiting
reach ``ASYNCWORK["DLQ_ALERT_THRESHOLD"]``, checked every five minutes, sent at most once an
hour while they wait. The mail goes the way every email of the project goes, so it says which
way: if that is what fails, alert on the dead-letter depth metric too
(``asyncwork.contrib.monitoring``)."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.core.mail import get_connection, mail_admins
from django.core.mail.backends import smtp

from asyncwork.contrib.periodic.jobs import job
from asyncwork.deadletters import waiting
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

ALERT_PERIOD_SECONDS = 3600  # the alert repeats at most hourly while letters wait


@job("dlq-alert", every=timedelta(minutes=5))
def dlq_alert() -> int:
    """Alert (ERROR line and mail to ADMINS) when waiting dead letters reach the threshold, at most
    once per period. Returns the depth."""
    depth = waiting().count()
    if depth >= asyncwork_settings.DLQ_ALERT_THRESHOLD and cache.add(
        "dlq-alert-sent", depth, timeout=ALERT_PERIOD_SECONDS
    ):
        logger.error(
            "DLQ depth %d has reached the alert threshold %d",
            depth,
            asyncwork_settings.DLQ_ALERT_THRESHOLD,
            extra={"dlq_depth": depth},
        )
        channel = mail_channel()
        try:
            mail_admins(
                f"Dead-letter queue depth {depth}",
                f"{depth} job(s) wait in the dead-letter queue.\n"
                "Inspect: python manage.py dlq list\nReplay: python manage.py dlq replay ID\n\n"
                f"This alert went through {channel}. If that is what fails, this mail does "
                "not arrive: alert on the dead-letter depth metric as well (the shipped "
                "Prometheus rules do).",
            )
        except Exception as exc:  # noqa: BLE001 - the ERROR line above is the alert that stays
            logger.warning("the alert mail through %s failed: %s", channel, exc)
    return depth


def mail_channel() -> str:
    """Which way Django's email goes, in words: a provider's API (django-anymail names it), an
    SMTP server, or the backend's dotted path."""
    try:
        backend = get_connection()
    except Exception:  # noqa: BLE001 - a backend that cannot start (no token) names nothing
        return f"EMAIL_BACKEND {settings.EMAIL_BACKEND}"
    provider = getattr(backend, "esp_name", None)
    if provider:
        return f"{provider}'s API ({settings.EMAIL_BACKEND})"
    if isinstance(backend, smtp.EmailBackend):
        return f"the SMTP server {backend.host}:{backend.port}"
    return f"EMAIL_BACKEND {settings.EMAIL_BACKEND}"
