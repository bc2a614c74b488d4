"""System checks of the project's own (Django's ``register``; imported by ``CoreConfig.ready``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register

from core.providers import ALLOWED_ORIGINS, provider_bases


@register(Tags.security, deploy=True)
def https_opt_out_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``check --deploy``: says once that ``DJANGO_SECURE_SSL_REDIRECT=0`` silenced Django's
    warnings about what it turns off."""
    if not settings.HTTPS_OPTED_OUT:
        return []
    return [
        Info(
            "HTTPS-only settings are off (DJANGO_SECURE_SSL_REDIRECT=0): no redirect to "
            "HTTPS, no HSTS, cookies not Secure-only; Django's warnings about them are "
            f"silenced ({', '.join(settings.HTTPS_OPT_OUT_CHECKS)}).",
            hint="Fine for plain HTTP on a laptop or a closed network. Serving the internet, "
            "terminate TLS in front of the app, list its address in TRUSTED_PROXIES, and leave "
            "DJANGO_SECURE_SSL_REDIRECT unset.",
            id="core.I001",
        )
    ]


@register(Tags.security, deploy=True)
def provider_bases_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``check --deploy``: names each provider API base that is not the provider's own (https on
    its domain), whose answers are taken as the provider's: an INFO for an https origin listed
    in ``PROVIDER_API_ALLOWED_ORIGINS``, a WARNING for plain HTTP or an origin not listed (taken
    only while DEBUG is on: start-up refuses it otherwise)."""
    messages: list[CheckMessage] = []
    bases = provider_bases(stripe_base=settings.STRIPE_API_BASE, anymail=settings.ANYMAIL)
    for base in bases:
        if base.providers_own:
            continue
        origin = base.origin
        which = (
            f"not {base.provider}'s own API"
            if base.domains
            else f"a host not known as {base.provider}'s"
        )
        said = (
            f"{base.setting} points at {origin or repr(base.url)}, {which}: what it answers is "
            f"taken as {base.provider}'s"
        )
        hint = f"Unset {base.setting} to reach {base.provider} itself." if base.domains else None
        if origin is None or origin not in settings.PROVIDER_API_ALLOWED_ORIGINS:
            why = f"{ALLOWED_ORIGINS} does not list it (refused at start-up with DEBUG off)"
            messages.append(Warning(f"{said}; {why}.", hint=hint, id="core.W001"))
        elif origin.startswith("http://"):
            why = f"over plain HTTP ({ALLOWED_ORIGINS} lists it)"
            messages.append(Warning(f"{said}, {why}.", hint=hint, id="core.W001"))
        else:
            why = f"{ALLOWED_ORIGINS} lists it"
            messages.append(Info(f"{said} ({why}).", hint=hint, id="core.I002"))
    return messages


@register()
def crash_window_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The timing the crash window's bound rests on (docs/explanation/guarantees.md), whoever
    set the values: a live claim is never taken over while its owner may still be sending, and
    the broker never hands a running task to a second worker."""
    errors: list[CheckMessage] = []
    if settings.EMAIL_CLAIM_LEASE_SECONDS <= settings.EMAIL_TASK_TIME_LIMIT:
        errors.append(
            Error("EMAIL_CLAIM_LEASE_SECONDS must exceed EMAIL_TASK_TIME_LIMIT.", id="core.E001")
        )
    # Redis only: RabbitMQ redelivers when the connection closes, not after a timeout.
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout")
    limits = max(settings.EMAIL_TASK_TIME_LIMIT, settings.CELERY_TASK_TIME_LIMIT)
    if visibility is not None and limits >= visibility:
        errors.append(
            Error(
                "The broker's visibility_timeout must outlive the tasks' time limits "
                "(EMAIL_TASK_TIME_LIMIT, CELERY_TASK_TIME_LIMIT), or a running task is "
                "delivered twice.",
                id="core.E002",
            )
        )
    return errors
