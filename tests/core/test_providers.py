"""core.providers: where the providers' APIs may be reached, through ``manage.py`` on production
settings in a process of its own. With DEBUG off, ``STRIPE_API_BASE`` and every
``ANYMAIL_<ESP>_API_URL`` are https on the provider's own domain, or an origin listed in
``PROVIDER_API_ALLOWED_ORIGINS``; any other stops start-up in one line naming both settings.
``check --deploy`` names each base that is not the provider's own."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.environment import PRODUCTION, manage, settings_read

pytestmark = pytest.mark.slow  # each test reads the settings in a process of its own

ALLOWED = "PROVIDER_API_ALLOWED_ORIGINS"


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused configuration prints, once it is the only thing printed."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("Configuration error: "), line
    return line.removeprefix("Configuration error: ")


def issues(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What ``check`` reported, one line each, without the hints."""
    return [line for line in result.stderr.splitlines() if line.startswith("?: (")]


@pytest.mark.parametrize(
    ("name", "value", "origin", "provider"),
    [
        # The provider's host, in plain HTTP: anyone on the path answers as Stripe.
        ("STRIPE_API_BASE", "http://api.stripe.com", "http://api.stripe.com", "Stripe"),
        # A look-alike host.
        (
            "STRIPE_API_BASE",
            "https://api.stripe.com.attacker.example",
            "https://api.stripe.com.attacker.example",
            "Stripe",
        ),
        # A stand-in's, as the tests run one.
        ("STRIPE_API_BASE", "http://127.0.0.1:12111/", "http://127.0.0.1:12111", "Stripe"),
        (
            "ANYMAIL_POSTMARK_API_URL",
            "http://127.0.0.1:9/",
            "http://127.0.0.1:9",
            "Postmark",
        ),
        (
            "ANYMAIL_MAILGUN_API_URL",
            "https://mailgun.attacker.example/v3",
            "https://mailgun.attacker.example",
            "Mailgun",
        ),
    ],
)
def test_a_base_elsewhere_stops_start_up_in_one_line_naming_what_to_set(
    name: str, value: str, origin: str, provider: str
) -> None:
    line = refusal(manage("check", env={**PRODUCTION, name: value}))
    assert line.startswith(f"{name} points at {origin}, not {provider}'s own API (https on "), line
    assert line.endswith(f"unset {name}, or list {origin} in {ALLOWED} to trust it."), line


def test_a_provider_with_no_known_domain_needs_its_origin_listed() -> None:
    """Postal is self-hosted: its host is the operator's own, never a known provider's."""
    env = {**PRODUCTION, "ANYMAIL_POSTAL_API_URL": "https://postal.example.com/"}
    assert refusal(manage("check", env=env)) == (
        "ANYMAIL_POSTAL_API_URL points at https://postal.example.com, a host this application "
        "does not know as Postal's: what it answers would be taken as Postal's; list "
        f"https://postal.example.com in {ALLOWED} to trust it."
    )
    listed = {**env, ALLOWED: "https://postal.example.com"}
    assert settings_read("ANYMAIL['POSTAL_API_URL']", env=listed) == [
        "'https://postal.example.com/'"
    ]


@pytest.mark.parametrize(
    "value",
    [
        "api.stripe.com",
        "ftp://api.stripe.com",
        "https:///v1",
        # A host hidden behind the provider's name as a user.
        "https://api.stripe.com@attacker.example",
        # What urlsplit reads as api.stripe.com, and urllib3 (the requests) as attacker.example.
        "https://attacker.example\\@api.stripe.com",
        # urlsplit drops the tab.
        "https://api.stri\tpe.com",
    ],
)
def test_a_base_that_is_not_an_http_url_of_a_host_stops_start_up(value: str) -> None:
    assert refusal(manage("check", env={**PRODUCTION, "STRIPE_API_BASE": value})) == (
        "STRIPE_API_BASE must be an https URL of a host name or address, with no user or "
        f"password (got {value!r})."
    )


def test_the_providers_own_hosts_need_nothing_and_pass_check_deploy() -> None:
    env = {
        **PRODUCTION,
        "STRIPE_API_BASE": "https://api.stripe.com/",
        "ANYMAIL_POSTMARK_API_URL": "https://api.postmarkapp.com/",
        # Regional hosts are under the provider's domain too.
        "ANYMAIL_MAILGUN_API_URL": "https://api.eu.mailgun.net/v3",
        "ANYMAIL_SPARKPOST_API_URL": "https://api.eu.sparkpost.com/api/v1/",
    }
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout
    assert settings_read("STRIPE_API_BASE", env=env) == ["'https://api.stripe.com'"]


def test_a_listed_origin_is_taken_and_check_deploy_names_its_setting() -> None:
    env = {
        **PRODUCTION,
        "STRIPE_API_BASE": "https://stripe-egress.internal:8443",
        "ANYMAIL_POSTMARK_API_URL": "http://127.0.0.1:9/",
        # Read as origins: case and default ports do not matter.
        ALLOWED: "https://Stripe-Egress.internal:8443, http://127.0.0.1:9, https://x.example:443",
    }
    assert settings_read("STRIPE_API_BASE", "ANYMAIL['POSTMARK_API_URL']", ALLOWED, env=env) == [
        "'https://stripe-egress.internal:8443'",
        "'http://127.0.0.1:9/'",
        # As written; compared as origins (core.checks.allowed_origins).
        "['https://Stripe-Egress.internal:8443', 'http://127.0.0.1:9', 'https://x.example:443']",
    ]
    reported = manage("check", "--deploy", env=env)
    assert reported.returncode == 0, reported.stderr
    assert issues(reported) == [  # Django's order: warnings, then infos
        "?: (core.W001) ANYMAIL_POSTMARK_API_URL points at http://127.0.0.1:9, not Postmark's "
        "own API: what it answers is taken as Postmark's, over plain HTTP "
        f"({ALLOWED} lists it).",
        "?: (core.I002) STRIPE_API_BASE points at https://stripe-egress.internal:8443, not "
        "Stripe's own API: what it answers is taken as Stripe's "
        f"({ALLOWED} lists it).",
    ]
    assert "HINT: Unset STRIPE_API_BASE to reach Stripe itself." in reported.stderr
    # Plain HTTP fails a deployment's check; an https origin listed is only said.
    strict = manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert strict.returncode == 1
    https_only = {k: v for k, v in env.items() if k != "ANYMAIL_POSTMARK_API_URL"}
    assert manage("check", "--deploy", "--fail-level", "WARNING", env=https_only).returncode == 0


def test_while_debugging_any_base_is_taken_and_check_deploy_says_it_would_be_refused() -> None:
    env = {**PRODUCTION, "DJANGO_DEBUG": "1", "STRIPE_API_BASE": "http://127.0.0.1:12111"}
    assert settings_read("STRIPE_API_BASE", env=env) == ["'http://127.0.0.1:12111'"]
    reported = [i for i in issues(manage("check", "--deploy", env=env)) if "core." in i]
    assert reported == [
        "?: (core.W001) STRIPE_API_BASE points at http://127.0.0.1:12111, not Stripe's own "
        f"API: what it answers is taken as Stripe's; {ALLOWED} does not list it (refused at "
        "start-up with DEBUG off)."
    ]


@pytest.mark.parametrize(
    "entry",
    [
        "stripe-egress.internal",
        "https://stripe-egress.internal/v1",
        "https://user@stripe-egress.internal",
        "ftp://stripe-egress.internal",
        "https://stripe-egress.internal:99999",
    ],
)
def test_an_allowed_origin_that_is_not_an_origin_stops_start_up(entry: str) -> None:
    assert refusal(manage("check", env={**PRODUCTION, ALLOWED: entry})) == (
        f"{ALLOWED}: {entry!r} is not an origin like https://proxy.example.com:8443 (a scheme, "
        "a host, a port; no path)."
    )
