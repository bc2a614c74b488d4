"""Configuration: production is the default and refuses to start without secrets, passes
check --deploy, trusts X-Forwarded-Proto only from a trusted proxy, and Celery is
configured for at-least-once delivery."""

from __future__ import annotations

import ast
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlencode

import pytest
from django.conf import global_settings, settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import override_settings

from asyncwork.backend import RUN, TIME_LIMIT_GRACE, OutboxBackend
from core.celery import app
from invoicing.tasks import resend_invoice_email, send_invoice_email
from stack import launch
from stack.net import HOST
from stack.process import ROOT
from tests.helpers.environment import PRODUCTION, clean_env, manage, settings_read
from tests.helpers.http import Answer, send

pytestmark = pytest.mark.slow  # each test reads the settings in a process of its own


def test_debug_is_off_unless_asked_for() -> None:
    assert settings_read("DEBUG", env=PRODUCTION) == ["False"]
    for off in ("0", "false", ""):
        assert settings_read("DEBUG", env={**PRODUCTION, "DJANGO_DEBUG": off}) == ["False"], off
    for on in ("1", "true"):
        assert settings_read("DEBUG", env={**PRODUCTION, "DJANGO_DEBUG": on}) == ["True"], on


def test_development_secrets_exist_only_while_debug_is_on() -> None:
    key, webhook = settings_read("SECRET_KEY", "STRIPE_WEBHOOK_SECRETS", env={"DJANGO_DEBUG": "1"})
    assert key.startswith("'django-insecure-")
    assert webhook == "['whsec_development_only']"
    # Set, they win even while debugging.
    assert settings_read("SECRET_KEY", env={**PRODUCTION, "DJANGO_DEBUG": "1"}) == [
        repr(PRODUCTION["DJANGO_SECRET_KEY"])
    ]


@pytest.mark.parametrize("missing", ["DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET"])
def test_production_without_a_secret_stops_with_a_clear_message(missing: str) -> None:
    env = {k: v for k, v in PRODUCTION.items() if k != missing}
    result = manage("check", env=env)
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        f"Configuration error: {missing} must be set when DJANGO_DEBUG is off (the default): "
        "it has no production default."
    ]


def test_production_without_any_secret_names_both_at_once() -> None:
    result = manage("check", env={"DJANGO_ALLOWED_HOSTS": "billing.example.com"})
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "Configuration error: DJANGO_SECRET_KEY and STRIPE_WEBHOOK_SECRET must be set when "
        "DJANGO_DEBUG is off (the default): they have no production default."
    ]


@pytest.mark.parametrize("proxies", [{}, {"TRUSTED_PROXIES": "10.0.0.2"}])
def test_production_configuration_passes_check_deploy(proxies: dict[str, str]) -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", env={**PRODUCTION, **proxies})
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_an_explicit_https_opt_out_silences_only_its_own_deploy_warnings() -> None:
    opted_out = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        env={**PRODUCTION, "DJANGO_SECURE_SSL_REDIRECT": "0"},
    )
    assert opted_out.returncode == 0, opted_out.stderr
    assert "(core.I001) HTTPS-only settings are off" in opted_out.stderr  # said once, not hidden
    assert "?: (security." not in opted_out.stderr
    assert "(4 silenced)" in opted_out.stderr
    # Every other deployment check still applies: a weak key is still reported.
    weak_key = manage(
        "check",
        "--deploy",
        env={**PRODUCTION, "DJANGO_SECURE_SSL_REDIRECT": "0", "DJANGO_SECRET_KEY": "short"},
    )
    assert "(security.W009)" in weak_key.stderr
    # HTTPS off only because DEBUG is on is not an opt-out: all four warnings stay.
    debugging = manage("check", "--deploy", env={**PRODUCTION, "DJANGO_DEBUG": "1"})
    for warning in ("W004", "W008", "W012", "W016", "W018"):
        assert f"(security.{warning})" in debugging.stderr, warning
    assert "core.I001" not in debugging.stderr


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


# gunicorn as the README and the Docker image start it (reading ./gunicorn.conf.py), and as
# compose.yaml does.
GUNICORN_COMMANDS = {
    "gunicorn core.wsgi": ["core.wsgi"],
    "gunicorn -c gunicorn.conf.py core.wsgi": ["-c", "gunicorn.conf.py", "core.wsgi"],
}


@contextmanager
def gunicorn(args: list[str], *, static_root: Path, **env: str) -> Iterator[int]:
    """``gunicorn <args>`` on core.settings, as production runs it, with ``env`` and the static
    files collected in ``static_root``; yields its port once it answers. The database is this
    test's."""
    db = connection.settings_dict
    server = launch.gunicorn(
        clean_env(
            DJANGO_SETTINGS_MODULE="core.settings",
            DJANGO_STATIC_ROOT=str(static_root),
            DATABASE_URL=f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            **{k: os.environ[k] for k in ("CELERY_BROKER_KEY_PREFIX", "REDIS_KEY_PREFIX")},
            CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
            REDIS_URL=settings.REDIS_URL,
            **PRODUCTION,
            **env,
        ),
        args=args,
        ready_path="/admin/login/",
        ready_status=None,  # any answer: Django's redirect, or its refusal of the Host
    )
    with server:
        yield server.port


PROXY, AROUND = HOST, "127.0.0.2"  # the trusted proxy, and a client reaching gunicorn directly
SITE = "billing.example.com"
LOGIN_URL = "/admin/login/"


def login_page(port: int, *, forwarded_proto: str, source: str = PROXY) -> Answer:
    """A plain-HTTP request from ``source`` as a proxy forwards it: its Host, and what it says
    the client's scheme was."""
    return send(
        port,
        source=source,
        method="GET",
        path=LOGIN_URL,
        headers={"Host": SITE, "X-Forwarded-Proto": forwarded_proto},
    )


def cookies(answer: Answer) -> dict[str, str]:
    """Each cookie the answer sets, by name: its whole Set-Cookie line."""
    lines = answer.headers.get_all("Set-Cookie") or []
    return {line.partition("=")[0]: line for line in lines}


def secure(cookie: str) -> bool:
    return "secure" in [part.strip().lower() for part in cookie.split(";")]


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize("command", GUNICORN_COMMANDS)
def test_x_forwarded_proto_is_ignored_without_a_trusted_proxy(
    command: str, collected_static: Path
) -> None:
    # From loopback, the peer gunicorn itself would trust (gunicorn.conf.py).
    args = GUNICORN_COMMANDS[command]
    with gunicorn(args, static_root=collected_static, DJANGO_SECURE_SSL_REDIRECT="1") as port:
        spoofed = login_page(port, forwarded_proto="https")
    # The client's own header: a plain-HTTP request is still sent to HTTPS.
    assert spoofed.status == 301
    assert spoofed.headers["Location"] == f"https://{SITE}{LOGIN_URL}"


@pytest.mark.slow
@pytest.mark.django_db
def test_behind_a_tls_balancer_and_the_edge_https_holds_and_a_client_cannot_claim_it(
    collected_static: Path,
) -> None:
    """Production's gunicorn (HTTPS redirect, Secure cookies, HSTS) behind the real edge, and
    the edge behind a TLS load balancer (PROXY, in EDGE_TRUSTED_PROXIES): what the balancer
    says (https) is served with Secure cookies, not redirected again; a client reaching the
    edge directly and claiming https is redirected (the edge replaced its header)."""
    args = GUNICORN_COMMANDS["gunicorn -c gunicorn.conf.py core.wsgi"]
    with (
        gunicorn(
            args,
            static_root=collected_static,
            DJANGO_SECURE_SSL_REDIRECT="1",
            TRUSTED_PROXIES=f"{HOST}/32",  # the edge connects from loopback's 127.0.0.1
        ) as port,
        launch.edge(
            port, rate=10, burst=10, in_flight=4, settings={"EDGE_TRUSTED_PROXIES": f"{PROXY}/32"}
        ) as edge,
    ):
        balanced = login_page(edge.port, forwarded_proto="https")
        claimed = login_page(edge.port, forwarded_proto="https", source=AROUND)
    assert balanced.status == 200
    assert "Strict-Transport-Security" in balanced.headers
    assert secure(cookies(balanced)["csrftoken"])
    assert claimed.status == 301
    assert claimed.headers["Location"] == f"https://{SITE}{LOGIN_URL}"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_x_forwarded_proto_counts_only_from_a_trusted_proxy(collected_static: Path) -> None:
    # The password hashed as production hashes it: gunicorn on core.settings checks it, and
    # knows nothing of the tests' own hasher (tests/settings.py).
    with override_settings(PASSWORD_HASHERS=global_settings.PASSWORD_HASHERS):
        get_user_model().objects.create_superuser("boss", "boss@example.com", "right-horse-battery")
    args = GUNICORN_COMMANDS["gunicorn core.wsgi"]
    with gunicorn(
        args,
        static_root=collected_static,
        DJANGO_SECURE_SSL_REDIRECT="1",
        TRUSTED_PROXIES=f"{PROXY}/32",
    ) as port:
        over_https = login_page(port, forwarded_proto="https")
        token = cookies(over_https)["csrftoken"].partition("=")[2].partition(";")[0]
        form = {"username": "boss", "password": "right-horse-battery"}
        logged_in = send(
            port,
            path=f"{LOGIN_URL}?next=/admin/",
            body=urlencode({**form, "csrfmiddlewaretoken": token}).encode(),
            headers={
                "Host": SITE,
                "X-Forwarded-Proto": "https",
                "Origin": f"https://{SITE}",  # CSRF's check of an HTTPS request
                "Content-Type": "application/x-www-form-urlencoded",
                "Cookie": f"csrftoken={token}",
            },
        )
        over_http = login_page(port, forwarded_proto="http")
        spoofed = login_page(port, forwarded_proto="https", source=AROUND)
    # TLS ended at the proxy: served, not redirected again (no loop), with HTTPS-only headers
    # and cookies sent only over HTTPS.
    assert over_https.status == 200
    assert "Strict-Transport-Security" in over_https.headers
    assert secure(cookies(over_https)["csrftoken"])
    assert logged_in.status == 302, logged_in.body[:500]
    assert secure(cookies(logged_in)["sessionid"])
    # The proxy says the client came over plain HTTP: redirected.
    assert over_http.status == 301
    assert over_http.headers["Location"] == f"https://{SITE}{LOGIN_URL}"
    # A client reaching gunicorn around the proxy cannot pass as HTTPS: redirected.
    assert spoofed.status == 301
    assert spoofed.headers["Location"] == f"https://{SITE}{LOGIN_URL}"
    assert "Strict-Transport-Security" not in spoofed.headers


@pytest.mark.slow
@pytest.mark.django_db
def test_metrics_answer_loopback_only_or_the_token(collected_static: Path) -> None:
    """Production's /metrics: loopback only, judged on the client the trusted proxy names (a
    private address is not enough); with METRICS_TOKEN, the token."""
    args = GUNICORN_COMMANDS["gunicorn core.wsgi"]

    def metrics(port: int, **headers: str) -> int:
        return send(port, method="GET", path="/metrics", headers={"Host": SITE, **headers}).status

    with gunicorn(args, static_root=collected_static, TRUSTED_PROXIES=f"{PROXY}/32") as port:
        by_network = {
            forwarded: metrics(port, **({"X-Forwarded-For": forwarded} if forwarded else {}))
            for forwarded in ("", "127.0.0.1", "203.0.113.5", "10.1.2.3", "172.17.0.1")
        }
    assert by_network == {
        "": 200,  # the proxy's own request, from loopback
        "127.0.0.1": 200,
        "203.0.113.5": 403,
        "10.1.2.3": 403,
        "172.17.0.1": 403,  # Docker's gateway
    }
    token = "metrics-" + "t0k3n" * 6
    with gunicorn(
        args, static_root=collected_static, TRUSTED_PROXIES=f"{PROXY}/32", METRICS_TOKEN=token
    ) as port:
        assert metrics(port) == 401  # even from loopback
        assert metrics(port, Authorization="Bearer wrong") == 401
        assert metrics(port, Authorization=f"Bearer {token}") == 200
        assert (
            metrics(port, Authorization=f"Bearer {token}", **{"X-Forwarded-For": "203.0.113.5"})
            == 200
        )


@pytest.mark.parametrize("setting", ["TRUSTED_PROXIES", "METRICS_ALLOWED_NETWORKS"])
@pytest.mark.parametrize("entry", ["10.0.0.300", "edge", "10.0.0.0/33"])
def test_a_bad_network_stops_start_up_naming_it(setting: str, entry: str) -> None:
    result = manage("check", env={**PRODUCTION, setting: f"10.0.0.2, {entry}"})
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        f"Configuration error: ASYNCWORK[{setting!r}] is ['10.0.0.2', {entry!r}]: it must be a "
        "list of addresses or networks (like 10.0.0.2 or 10.0.0.0/24)."
    ]


def test_trusted_proxies_are_read_as_networks() -> None:
    env = {**PRODUCTION, "TRUSTED_PROXIES": "10.0.0.2, 2001:db8::/32"}
    names = ("ASYNCWORK['TRUSTED_PROXIES']", "SECURE_PROXY_SSL_HEADER")
    # Django reads the scheme gunicorn set, whose trust is the same networks (gunicorn.conf.py).
    assert settings_read(*names, env=env) == ["['10.0.0.2', '2001:db8::/32']", "None"]
    assert gunicorn_trust(env) == ("10.0.0.2/32,2001:db8::/32", {"X-FORWARDED-PROTO": "https"})
    # None by default: no header counts, not even loopback's (gunicorn's own default).
    assert settings_read(*names, env=PRODUCTION) == ["[]", "None"]
    assert gunicorn_trust(PRODUCTION)[0] == ""


def gunicorn_trust(env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``forwarded_allow_ips`` and ``secure_scheme_headers`` as gunicorn.conf.py sets them."""
    code = (
        "import runpy; c = runpy.run_path('gunicorn.conf.py'); "
        "print(repr((c['forwarded_allow_ips'], c['secure_scheme_headers'])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=clean_env(DJANGO_SETTINGS_MODULE="core.settings", **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    trust: tuple[str, dict[str, str]] = ast.literal_eval(result.stdout)
    return trust


def test_zero_tolerance_is_refused() -> None:
    result = manage("check", env={**PRODUCTION, "STRIPE_WEBHOOK_TOLERANCE": "0"})
    assert result.returncode != 0
    assert "STRIPE_WEBHOOK_TOLERANCE must be a positive number" in result.stderr


_PRINT_BROKER = (
    "from django.conf import settings as s; from core.celery import app; "
    "from asyncwork import broker; o = app.conf.broker_transport_options; "
    "q = broker.consumed()[0]; "
    "print(broker.rabbitmq(), app.conf.broker_transport or '-', "
    "o.get('confirm_publish', '-'), o.get('visibility_timeout', '-'), "
    "o.get('queue_order_strategy', '-'), "
    "(q.queue_arguments or {}).get('x-queue-type', '-'), q.exchange.type or '-')"
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # Redis: the transport with the acknowledgement fix, lists read in priority order, the
        # visibility timeout.
        ("redis://127.0.0.1:6379/0", "False asyncwork.broker:Transport - 180 priority - direct"),
        # RabbitMQ: kombu's own transport, confirms, quorum queues behind topic exchanges
        # (native delayed delivery); no visibility timeout, no Redis fix.
        ("amqp://u:p@127.0.0.1:5672/v", "True - True - - quorum topic"),
    ],
)
def test_the_broker_url_decides_what_is_broker_specific(url: str, expected: str) -> None:
    env = {**PRODUCTION, "CELERY_BROKER_URL": url}
    result = manage("shell", "--no-imports", "-c", _PRINT_BROKER, env=env)
    assert result.stdout.strip() == expected, result.stderr


def test_comma_separated_webhook_secrets_while_rolling() -> None:
    assert settings.STRIPE_WEBHOOK_SECRETS == ["whsec_test_primary", "whsec_test_rolled"]


def test_celery_is_configured_for_at_least_once_delivery() -> None:
    """What ``asyncwork.install`` sets where the project's Celery block left Celery's default,
    and the email tasks' policy on the project's backend."""
    conf = app.conf
    assert conf.task_serializer == "json"
    assert conf.accept_content == ["json"]
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_time_limit
    assert conf.task_soft_time_limit
    app.loader.import_default_modules()  # what a worker does at start
    # Never the dlq; each queue after the one a job published again goes to (read in order).
    assert [q.name for q in conf.task_queues] == [
        "default-recovery",
        "default",
        "email-recovery",
        "email",
    ]
    assert conf.broker_transport_options["queue_order_strategy"] == "priority"
    runner = app.tasks[RUN]  # every job's message names it
    assert runner.acks_late
    assert runner.reject_on_worker_lost
    assert isinstance(send_invoice_email.get_backend(), OutboxBackend)
    for email_task in (send_invoice_email, resend_invoice_email):
        assert email_task.queue_name == "email"
        assert email_task.max_attempts == 5
        assert email_task.time_limit is not None
        hard_limit = email_task.time_limit + TIME_LIMIT_GRACE
        # A retry waits in PostgreSQL (its due time), not in the broker: the visibility timeout
        # need only outlive a run, and a live claim is never taken over mid-send.
        assert conf.broker_transport_options["visibility_timeout"] > hard_limit
        assert hard_limit < settings.EMAIL_CLAIM_LEASE_SECONDS


_PRINT_SCOPE = (
    "from django.conf import settings as s; "
    "print(s.STRIPE_LIVEMODE, s.STRIPE_ACCOUNT or '-', ','.join(s.INVOICE_URL_ALLOWED_HOSTS))"
)


def test_stripe_livemode_is_live_in_production_and_test_while_debugging() -> None:
    production = manage("shell", "--no-imports", "-c", _PRINT_SCOPE, env=PRODUCTION)
    debugging = manage("shell", "--no-imports", "-c", _PRINT_SCOPE, env={"DJANGO_DEBUG": "1"})
    assert production.stdout.split() == ["live", "-", "invoice.stripe.com"], production.stderr
    assert debugging.stdout.split() == ["test", "-", "invoice.stripe.com"], debugging.stderr


def test_scope_and_link_settings_are_read_and_normalised() -> None:
    env = {
        **PRODUCTION,
        "STRIPE_LIVEMODE": " Any ",
        "STRIPE_ACCOUNT": "acct_1Abc",
        "INVOICE_URL_ALLOWED_HOSTS": "Invoice.Stripe.com, billing.example.com",
    }
    result = manage("shell", "--no-imports", "-c", _PRINT_SCOPE, env=env)
    assert result.stdout.split() == [
        "any",
        "acct_1Abc",
        "invoice.stripe.com,billing.example.com",
    ], result.stderr


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("STRIPE_LIVEMODE", "production", "STRIPE_LIVEMODE must be live, test or any"),
        ("STRIPE_ACCOUNT", "acct 1; drop", "STRIPE_ACCOUNT must be a Stripe account id"),
        ("INVOICE_URL_ALLOWED_HOSTS", "https://invoice.stripe.com", "is not a host name"),
        ("INVOICE_URL_ALLOWED_HOSTS", "*.stripe.com", "is not a host name"),
        ("API_TOKEN_TTL_HOURS", "0", "ASYNCWORK['API_TOKEN_TTL_HOURS'] is 0: it must be"),
        ("API_TOKEN_MAX_HOURS", "12", "ASYNCWORK['API_TOKEN_TTL_HOURS'] (24) must be at most"),
    ],
)
def test_bad_settings_stop_start_up_with_a_clear_message(
    name: str, value: str, message: str
) -> None:
    result = manage("check", env={**PRODUCTION, name: value})
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_default_token_lifetime_above_the_maximum_stops_start_up_naming_both() -> None:
    result = manage(
        "check", env={**PRODUCTION, "API_TOKEN_TTL_HOURS": "3000", "API_TOKEN_MAX_HOURS": "2160"}
    )
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "Configuration error: ASYNCWORK['API_TOKEN_TTL_HOURS'] (3000) must be at most "
        "ASYNCWORK['API_TOKEN_MAX_HOURS'] (2160): the default lifetime of a token is one it may "
        "have."
    ]
    allowed = manage(
        "shell",
        "--no-imports",
        "-c",
        "from asyncwork.settings import asyncwork_settings as s; "
        "print(s.API_TOKEN_TTL_HOURS, s.API_TOKEN_MAX_HOURS)",
        env={**PRODUCTION, "API_TOKEN_TTL_HOURS": "2160"},
    )
    assert allowed.stdout.split() == ["2160", "2160"], allowed.stderr


# As docs/how-to/send-through-a-provider.md says to make one: secrets.token_urlsafe(32), 43
# characters.
WEBHOOK_PASSWORD = "Vr0oCJgk2xWbq9d4n7Y1sT6uEa3LhZ8mPfKw5XcQyBN"
WEBHOOK_SECRET_REFUSED = (
    "Configuration error: ANYMAIL_WEBHOOK_SECRET must be user:password with a password of at "
    "least 24 characters; make one with "
    "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'."
)


@pytest.mark.parametrize(
    "secret",
    [
        "postmark:s3cret",
        "postmark:" + "p" * 23,
        "a-password-but-no-user-and-no-colon",
        # While a secret is rolled, a list: every entry is held to it.
        f'["postmark:{WEBHOOK_PASSWORD}", "old:short"]',
        "12345",  # read as JSON: a number
    ],
)
def test_a_short_tracking_webhook_password_stops_start_up_in_one_line(secret: str) -> None:
    result = manage("check", env={**PRODUCTION, "ANYMAIL_WEBHOOK_SECRET": secret})
    assert result.returncode == 1
    # Exactly this line: the value, a secret, is never echoed.
    assert result.stderr.splitlines() == [WEBHOOK_SECRET_REFUSED]


def test_a_tracking_webhook_password_of_24_characters_or_more_is_taken() -> None:
    made = secrets.token_urlsafe(32)
    for secret, read in [
        (f"postmark:{made}", f"postmark:{made}"),
        ("postmark:" + "p" * 24, "postmark:" + "p" * 24),
        (
            f'["postmark:{made}", "old:{WEBHOOK_PASSWORD}"]',
            [f"postmark:{made}", f"old:{WEBHOOK_PASSWORD}"],
        ),
        ("", ""),  # set empty, as compose.yaml passes it unset: the tracking webhooks are off
    ]:
        env = {**PRODUCTION, "ANYMAIL_WEBHOOK_SECRET": secret}
        assert settings_read("ANYMAIL['WEBHOOK_SECRET']", env=env) == [repr(read)]


def test_the_email_backend_and_every_anymail_variable_come_from_the_environment() -> None:
    env = {
        **PRODUCTION,
        "EMAIL_BACKEND": "anymail.backends.postmark.EmailBackend",
        "ANYMAIL_POSTMARK_SERVER_TOKEN": "b3f1c2d4-0000-4000-8000-000000000000",
        "ANYMAIL_POSTMARK_API_URL": "http://127.0.0.1:9/",
        "PROVIDER_API_ALLOWED_ORIGINS": "http://127.0.0.1:9",  # a stand-in's (core.providers)
        "ANYMAIL_WEBHOOK_SECRET": f"postmark:{WEBHOOK_PASSWORD}",
        "ANYMAIL_IGNORE_RECIPIENT_STATUS": "false",
        "ANYMAIL_REQUESTS_TIMEOUT": "[3, 7]",
        "ANYMAIL_SEND_DEFAULTS": '{"tags": ["invoice"]}',
    }
    backend, anymail = settings_read("EMAIL_BACKEND", "ANYMAIL", env=env)
    assert backend == "'anymail.backends.postmark.EmailBackend'"
    assert ast.literal_eval(anymail) == {
        "POSTMARK_SERVER_TOKEN": "b3f1c2d4-0000-4000-8000-000000000000",
        "POSTMARK_API_URL": "http://127.0.0.1:9/",
        "WEBHOOK_SECRET": f"postmark:{WEBHOOK_PASSWORD}",
        "IGNORE_RECIPIENT_STATUS": False,
        "REQUESTS_TIMEOUT": [3, 7],
        "SEND_DEFAULTS": {"tags": ["invoice"]},
    }
    # Unset, SMTP and no anymail settings.
    assert settings_read("EMAIL_BACKEND", "ANYMAIL", env=PRODUCTION) == [
        "'asyncwork.contrib.mail.EmailBackend'",
        "{}",
    ]
