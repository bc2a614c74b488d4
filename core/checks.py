"""The project's own checks of its settings: ``settings_refusals``, what no process may start
with (``core.startup`` stops gunicorn, the workers and beat on it, ``CoreConfig.ready`` every
``manage.py`` command), and the system checks (Django's ``register``) that only warn, or that
hold any settings module (the tests', the chaos run's) to the timing the guarantees rest on."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register

from asyncwork.contrib.http import origin_listed
from core.providers import ALLOWED_ORIGINS, base_refusal, provider_bases

# The tracking webhooks' password (invoicing/bounces.py) is all a forger of bounces has to guess.
WEBHOOK_PASSWORD_MIN = 24
_HOST_NAME = re.compile(r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9-]{2,63}")


def allowed_origins() -> list[str]:
    """``PROVIDER_API_ALLOWED_ORIGINS`` as origins (its entries that are one)."""
    found = []
    for entry in settings.PROVIDER_API_ALLOWED_ORIGINS:
        try:
            found.append(origin_listed(entry))
        except ValueError:
            continue
    return found


def settings_refusals() -> list[str]:
    """Each setting no process may start with, in one line naming the variable to fix."""
    s = settings
    refused = []
    if s.STRIPE_WEBHOOK_TOLERANCE <= 0:
        # stripe-python treats a falsy tolerance as "no check": never allow that.
        refused.append("STRIPE_WEBHOOK_TOLERANCE must be a positive number of seconds.")
    if s.STRIPE_LIVEMODE not in {"live", "test", "any"}:
        refused.append(f"STRIPE_LIVEMODE must be live, test or any (got {s.STRIPE_LIVEMODE!r}).")
    if s.STRIPE_ACCOUNT and not re.fullmatch(r"acct_[A-Za-z0-9]+", s.STRIPE_ACCOUNT):
        refused.append(
            "STRIPE_ACCOUNT must be a Stripe account id like acct_1A2b3C "
            f"(got {s.STRIPE_ACCOUNT!r})."
        )
    auth = s.ANYMAIL.get("WEBHOOK_SECRET") or []
    auths = [auth] if isinstance(auth, str) else auth
    if not isinstance(auths, list) or not all(
        isinstance(a, str) and len(a.partition(":")[2]) >= WEBHOOK_PASSWORD_MIN for a in auths
    ):
        # Never the value itself: it is a secret, and this line goes to the logs.
        refused.append(
            "ANYMAIL_WEBHOOK_SECRET must be user:password with a password of at least "
            f"{WEBHOOK_PASSWORD_MIN} characters; make one with "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'."
        )
    refused += [
        f"INVOICE_URL_ALLOWED_HOSTS: {host!r} is not a host name like invoice.stripe.com "
        "(no scheme, port, path or wildcard)."
        for host in s.INVOICE_URL_ALLOWED_HOSTS
        if not _HOST_NAME.fullmatch(host)
    ]
    for entry in s.PROVIDER_API_ALLOWED_ORIGINS:
        try:
            origin_listed(entry)
        except ValueError:
            refused.append(
                f"PROVIDER_API_ALLOWED_ORIGINS: {entry!r} is not an origin like "
                "https://proxy.example.com:8443 (a scheme, a host, a port; no path)."
            )
    if not s.DEBUG:
        for base in provider_bases(stripe_base=s.STRIPE_API_BASE, anymail=s.ANYMAIL):
            if refusal := base_refusal(base, allowed=allowed_origins()):
                refused.append(refusal)
    if s.EMAIL_RETRY_BACKOFF_BASE < 1 or s.EMAIL_RETRY_BACKOFF_MAX < 1:
        refused.append("EMAIL_RETRY_BACKOFF_BASE and _MAX must be at least 1 second.")
    if s.EMAIL_BREAKER_FAILURE_THRESHOLD < 1 or s.EMAIL_BREAKER_RESET_SECONDS < 1:
        refused.append(
            "EMAIL_BREAKER_FAILURE_THRESHOLD and EMAIL_BREAKER_RESET_SECONDS must be at least 1."
        )
    if s.EMAIL_PROVIDER_DEADLINE_SECONDS < s.EMAIL_BREAKER_RESET_SECONDS:
        refused.append("EMAIL_BREAKER_RESET_SECONDS must be at most a day (the provider deadline).")
    if s.WEBHOOK_RETENTION_DAYS < 3:
        refused.append(
            "WEBHOOK_RETENTION_DAYS must be at least 3: Stripe redelivers an event for up to 3 "
            "days, and only the stored event id makes the redelivery a duplicate."
        )
    if s.WEBHOOK_BODY_RETENTION_DAYS < 1:
        refused.append("WEBHOOK_BODY_RETENTION_DAYS must be at least 1.")
    return refused


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
        if origin is None or origin not in allowed_origins():
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
