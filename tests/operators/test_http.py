"""The client address (``operators.http.client_address``), and the admin login limit that keys on
it: django-axes through the real admin login form, PostgreSQL holding the attempts."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.test import Client, RequestFactory

from operators.http import client_address

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/?next=/admin/"
PASSWORD = "right-horse-battery-staple"


def proxies(settings: Any, count: int) -> None:
    # DRF reads NUM_PROXIES from REST_FRAMEWORK (and reloads when it changes).
    settings.NUM_PROXIES = count
    settings.REST_FRAMEWORK = {**django_settings.REST_FRAMEWORK, "NUM_PROXIES": count}


XFF = "HTTP_X_FORWARDED_FOR"


@pytest.mark.parametrize(
    ("num_proxies", "meta", "expected"),
    [
        (0, {"REMOTE_ADDR": "10.1.2.3"}, "10.1.2.3"),
        (0, {"REMOTE_ADDR": "10.1.2.3", XFF: "6.6.6.6"}, "10.1.2.3"),
        (1, {"REMOTE_ADDR": "10.0.0.9", XFF: "6.6.6.6, 203.0.113.5"}, "203.0.113.5"),
        (2, {"REMOTE_ADDR": "10.0.0.9", XFF: "6.6.6.6, 203.0.113.5, 10.0.0.8"}, "203.0.113.5"),
        (1, {"REMOTE_ADDR": "10.0.0.9"}, "10.0.0.9"),  # no header: the socket
        (1, {"REMOTE_ADDR": "10.0.0.9", XFF: "not-an-address"}, "10.0.0.9"),
        (1, {"REMOTE_ADDR": "::1", XFF: "2001:db8::1"}, "2001:db8::1"),
        (0, {"REMOTE_ADDR": ""}, None),
    ],
)
def test_client_address(
    settings: Any, num_proxies: int, meta: dict[str, Any], expected: Any
) -> None:
    proxies(settings, num_proxies)
    request = RequestFactory().get("/", **meta)
    assert client_address(request) == expected


@pytest.fixture
def admin_user() -> Any:
    return get_user_model().objects.create_superuser("boss", "boss@example.com", PASSWORD)


@pytest.fixture
def limit(settings: Any) -> int:
    settings.AXES_FAILURE_LIMIT = 3
    # Long enough that a slow request (password hashing on a busy machine) never outlasts it.
    settings.AXES_COOLOFF_TIME = timedelta(seconds=60)
    return 3


def log_in(client: Client, password: str, username: str = "boss", **meta: Any) -> Any:
    return client.post(LOGIN, {"username": username, "password": password}, **meta)


def logged_in(client: Client) -> bool:
    return SESSION_KEY in client.session


def test_the_limit_and_cool_off_come_from_settings() -> None:
    assert django_settings.AXES_FAILURE_LIMIT == django_settings.ADMIN_LOGIN_FAILURE_LIMIT == 5
    assert django_settings.ADMIN_LOGIN_COOLOFF_SECONDS == 900
    assert django_settings.AXES_COOLOFF_TIME.total_seconds() == 900
    assert django_settings.AXES_LOCKOUT_PARAMETERS == [["username", "ip_address"]]
    assert django_settings.AUTHENTICATION_BACKENDS[0] == "axes.backends.AxesStandaloneBackend"


def test_failures_lock_the_username_at_this_address_until_the_cool_off(
    settings: Any, admin_user: Any, limit: int
) -> None:
    settings.AXES_COOLOFF_TIME = timedelta(seconds=4)
    client = Client()
    answers = [log_in(client, "wrong").status_code for _ in range(limit)]
    # The form says the password is wrong, until the failure that reaches the limit.
    assert answers == [200] * (limit - 1) + [429]

    refused = log_in(client, PASSWORD)

    assert refused.status_code == 429
    assert b"too many login attempts" in refused.content
    assert not logged_in(client)
    attempt = AccessAttempt.objects.get()
    assert (attempt.username, attempt.ip_address) == ("boss", "127.0.0.1")
    assert attempt.failures_since_start == limit + 1  # the refused right password counts too

    time.sleep(4.5)  # the cool-off, since the last failure (the refused attempt)
    accepted = log_in(client, PASSWORD)

    assert accepted.status_code == 302
    assert accepted["Location"] == "/admin/"
    assert logged_in(client)
    assert not AccessAttempt.objects.exists()  # a success clears the count


def test_the_lock_is_per_username_and_address(admin_user: Any, limit: int) -> None:
    get_user_model().objects.create_superuser("other", "o@example.com", PASSWORD)
    for _ in range(limit):
        log_in(Client(), "wrong")

    assert log_in(Client(), PASSWORD).status_code == 429
    # The same username from another address, and another username from this one, log in.
    elsewhere = Client()
    assert log_in(elsewhere, PASSWORD, REMOTE_ADDR="10.9.9.9").status_code == 302
    assert logged_in(elsewhere)
    other = Client()
    assert log_in(other, PASSWORD, username="other").status_code == 302
    assert logged_in(other)


def test_behind_a_proxy_the_trusted_hop_is_the_address(
    settings: Any, admin_user: Any, limit: int
) -> None:
    proxies(settings, 1)
    for n in range(limit):
        # The client writes what it likes on the left; the proxy appends the real address.
        log_in(Client(), "wrong", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}, 203.0.113.5")

    forged = log_in(Client(), PASSWORD, HTTP_X_FORWARDED_FOR="198.51.100.99, 203.0.113.5")
    assert forged.status_code == 429
    assert AccessAttempt.objects.get().ip_address == "203.0.113.5"
    # Another client behind the same proxy is not locked out by this one.
    assert log_in(Client(), PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.77").status_code == 302


def test_without_trusted_proxies_a_forged_header_does_not_escape_the_lock(
    admin_user: Any, limit: int
) -> None:
    for n in range(limit):
        # A new forged address and a new user agent each time: neither is part of the key.
        log_in(Client(), "wrong", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}", HTTP_USER_AGENT=f"ua{n}")
    assert log_in(Client(), PASSWORD, HTTP_X_FORWARDED_FOR="198.51.100.200").status_code == 429
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {"127.0.0.1"}


def test_a_garbage_forwarded_header_is_no_500(settings: Any, admin_user: Any) -> None:
    proxies(settings, 1)
    response = log_in(Client(), "wrong", HTTP_X_FORWARDED_FOR="<script>, ::zz")
    assert response.status_code == 200
    assert AccessAttempt.objects.get().ip_address == "127.0.0.1"


@pytest.mark.parametrize(
    ("username", "password"),
    [("boss", "a\x00b"), ("bo\x00ss", "x"), ("b" * 400, "x"), ("boss", "p" * 5000)],
)
def test_hostile_login_input_is_a_form_error_never_a_500(
    admin_user: Any, username: str, password: str
) -> None:
    client = Client(raise_request_exception=False)
    response = client.post(
        LOGIN, {"username": username, "password": password}, HTTP_USER_AGENT="x" * 1000
    )
    assert response.status_code == 200
    assert b'<form action="/admin/login/' in response.content  # the form again, with its error
    assert b"errornote" in response.content
    assert not logged_in(client)
    for attempt in AccessAttempt.objects.all():  # filed within axes' columns, if at all
        assert len(attempt.username) <= 255
        assert "\x00" not in attempt.username
