"""Where the providers' APIs may be reached: ``STRIPE_API_BASE`` and every
``ANYMAIL_<ESP>_API_URL``. What a base answers is taken as the provider's word (the reconcile
records the events it lists as if they were signed; the email task takes its "accepted" as
sent), so with ``DJANGO_DEBUG`` off a base is https on the provider's own domain, or on an
origin the operator named in ``PROVIDER_API_ALLOWED_ORIGINS`` (a stand-in, an egress proxy).
``core/settings.py`` refuses any other at start-up; ``check --deploy`` names each base that is
not the provider's own (``core/checks.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from asyncwork.contrib.http import origin

ALLOWED_ORIGINS = "PROVIDER_API_ALLOWED_ORIGINS"
STRIPE = ("Stripe", ("stripe.com",))
# django-anymail's providers with an API URL setting (ANYMAIL_<NAME>_API_URL), and the domains
# of their default URLs (anymail/backends/*.py), whose regional hosts (api.eu.mailgun.net,
# go2.unisender.ru) are under the same. Postal is self-hosted: its host is the operator's.
ESPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "BREVO": ("Brevo", ("brevo.com", "sendinblue.com")),
    "SENDINBLUE": ("Brevo", ("brevo.com", "sendinblue.com")),
    "MAILERSEND": ("MailerSend", ("mailersend.com",)),
    "MAILGUN": ("Mailgun", ("mailgun.net",)),
    "MAILJET": ("Mailjet", ("mailjet.com",)),
    "MAILTRAP": ("Mailtrap", ("mailtrap.io",)),
    "MANDRILL": ("Mandrill", ("mandrillapp.com",)),
    "POSTMARK": ("Postmark", ("postmarkapp.com",)),
    "RESEND": ("Resend", ("resend.com",)),
    "SCALEWAY": ("Scaleway", ("scaleway.com",)),
    "SENDGRID": ("SendGrid", ("sendgrid.com",)),
    "SPARKPOST": ("SparkPost", ("sparkpost.com",)),
    "UNISENDER_GO": ("Unisender Go", ("unisender.ru",)),
}


class Base(NamedTuple):
    """One setting naming where a provider's API answers."""

    setting: str  # as the operator sets it: STRIPE_API_BASE, ANYMAIL_POSTMARK_API_URL
    url: Any  # as read (an ANYMAIL_ value may be read as JSON)
    provider: str  # its name, or the setting's ESP part when the provider is not known
    domains: tuple[str, ...]  # the provider's own; none for one not known (or self-hosted)

    @property
    def origin(self) -> str | None:
        """``scheme://host[:port]`` of an http or https URL; None for anything else."""
        try:
            return origin(self.url)
        except ValueError:
            return None

    @property
    def providers_own(self) -> bool:
        """https, on a host of the provider's own domains."""
        found = self.origin
        if found is None or not found.startswith("https://"):
            return False
        host = urlsplit(found).hostname or ""
        return any(host == d or host.endswith(f".{d}") for d in self.domains)


def provider_bases(*, stripe_base: Any, anymail: Mapping[str, Any]) -> list[Base]:
    """``STRIPE_API_BASE`` and each ``ANYMAIL_<ESP>_API_URL`` set."""
    bases = [Base("STRIPE_API_BASE", stripe_base, STRIPE[0], STRIPE[1])]
    for key, url in sorted(anymail.items()):
        if key.endswith("_API_URL"):
            esp = key.removesuffix("_API_URL")
            name, domains = ESPS.get(esp, (esp.replace("_", " ").title(), ()))
            bases.append(Base(f"ANYMAIL_{key}", url, name, domains))
    return bases


def base_refusal(base: Base, *, allowed: list[str]) -> str:
    """Why ``base`` may not be used with DEBUG off, naming the settings to change; "" if it may."""
    where = base.origin
    if where is None:
        return (
            f"{base.setting} must be an https URL of a host name or address, with no user or "
            f"password (got {base.url!r})."
        )
    if base.providers_own or where in allowed:
        return ""
    if base.domains:
        which = f"not {base.provider}'s own API (https on {' or '.join(base.domains)})"
        fix = f"unset {base.setting}, or list {where} in {ALLOWED_ORIGINS} to trust it"
    else:
        which = f"a host this application does not know as {base.provider}'s"
        fix = f"list {where} in {ALLOWED_ORIGINS} to trust it"
    return (
        f"{base.setting} points at {where}, {which}: what it answers would be taken as "
        f"{base.provider}'s; {fix}."
    )
