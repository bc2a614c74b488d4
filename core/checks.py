"""System checks of the project's own (Django's ``register``; imported by ``CoreConfig.ready``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Info, Tags, register


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
