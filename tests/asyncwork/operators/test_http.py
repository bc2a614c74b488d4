"""The client address (``asyncwork.contrib.http.client_address``), and the admin login limit that
keys on
it: django-axes through the real admin login form, PostgreSQL holding the attempts. Through real
gunicorn behind a trusted proxy: a client reaching it around the proxy is one client to the
login limit and the /metrics allow-list, however it rotates
X-Forwarded-For."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.test import Client, RequestFactory

from asyncwork.contrib.http import client_address
from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST
from tests.helpers.addresses import a_loopback_address, an_address
from tests.helpers.http import Answer, send
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/?next=/admin/"
PASSWORD = "right-horse-battery-staple"


XFF = "HTTP_X_FORWARDED_FOR"
EDGE = ["10.0.0.9", "::1"]  # the proxy in front, by address
RECURSIVE = ["10.0.0.0/24", "2001:db8:ffff::/48"]  # a network of proxies, one behind another


@pytest.mark.parametrize(
    ("trusted", "meta", "expected"),
    [
        ([], {"REMOTE_ADDR": "10.1.2.3"}, "10.1.2.3"),
        ([], {"REMOTE_ADDR": "10.0.0.9", XFF: "6.6.6.6"}, "10.0.0.9"),  # nothing trusted
        # The peer is not a trusted proxy: whatever the header says, the peer is the client.
        (EDGE, {"REMOTE_ADDR": "10.1.2.3", XFF: "6.6.6.6"}, "10.1.2.3"),
        (EDGE, {"REMOTE_ADDR": "10.1.2.3", XFF: "10.0.0.9"}, "10.1.2.3"),
        # From the trusted proxy: the rightmost entry; the client wrote the rest.
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "6.6.6.6, 203.0.113.5"}, "203.0.113.5"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: " 203.0.113.5 "}, "203.0.113.5"),
        (EDGE, {"REMOTE_ADDR": "::1", XFF: "2001:db8::1"}, "2001:db8::1"),
        (EDGE, {"REMOTE_ADDR": "::ffff:10.0.0.9", XFF: "203.0.113.5"}, "203.0.113.5"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "::ffff:203.0.113.5"}, "203.0.113.5"),
        # Trusted entries are skipped, as nginx's real_ip_recursive does; all trusted: leftmost.
        (
            RECURSIVE,
            {"REMOTE_ADDR": "10.0.0.1", XFF: "6.6.6.6, 203.0.113.5, 10.0.0.8"},
            "203.0.113.5",
        ),
        (RECURSIVE, {"REMOTE_ADDR": "10.0.0.1", XFF: "10.0.0.7,10.0.0.8"}, "10.0.0.7"),
        (
            RECURSIVE,
            {"REMOTE_ADDR": "10.0.0.1", XFF: "2001:db8::5, 2001:db8:ffff::2"},
            "2001:db8::5",
        ),
        # With only the edge trusted, 10.0.0.8 is the client (not a proxy the app knows).
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "203.0.113.5, 10.0.0.8"}, "10.0.0.8"),
        # No header, an empty one, or an entry that is not an address: the peer.
        (EDGE, {"REMOTE_ADDR": "10.0.0.9"}, "10.0.0.9"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: ""}, "10.0.0.9"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "not-an-address"}, "10.0.0.9"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "203.0.113.5, "}, "10.0.0.9"),
        (RECURSIVE, {"REMOTE_ADDR": "10.0.0.1", XFF: "203.0.113.5, unknown, 10.0.0.8"}, "10.0.0.1"),
        (EDGE, {"REMOTE_ADDR": "10.0.0.9", XFF: "203.0.113.5:4711"}, "10.0.0.9"),
        # An IPv6 scope is no part of an address PostgreSQL stores.
        (EDGE, {"REMOTE_ADDR": "fe80::1%eth0"}, "fe80::1"),
        ([], {"REMOTE_ADDR": ""}, None),
    ],
)
def test_client_address(
    settings: Any, trusted: list[str], meta: dict[str, Any], expected: Any
) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "TRUSTED_PROXIES": trusted}
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
    assert django_settings.AXES_FAILURE_LIMIT == 5
    assert django_settings.AXES_COOLOFF_TIME.total_seconds() == 900
    assert django_settings.AXES_COOLOFF_TIME.total_seconds() == 900
    assert django_settings.AXES_LOCKOUT_PARAMETERS == [["username", "ip_address"]]
    assert django_settings.AUTHENTICATION_BACKENDS[0] == "axes.backends.AxesStandaloneBackend"


@pytest.mark.slow
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
    # The test client's address.
    settings.ASYNCWORK = {**settings.ASYNCWORK, "TRUSTED_PROXIES": ["127.0.0.1"]}
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
    settings.ASYNCWORK = {**settings.ASYNCWORK, "TRUSTED_PROXIES": ["127.0.0.1"]}
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


# --- Through real gunicorn, behind a trusted proxy ---------------------------------------------

PROXY = HOST  # the trusted proxy connects from 127.0.0.1
INNER_PROXIES = "192.0.2.0/24"  # proxies further out, trusted too (recursive skipping)
GUNICORN_LIMIT = 3  # login failures per address

through_gunicorn = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def app(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """gunicorn (2 sync workers) on this run's test database, trusting 127.0.0.1 and the
    inner proxies; its port."""
    env = worker_env(
        0,
        {"AXES_FAILURE_LIMIT": GUNICORN_LIMIT},
        TRUSTED_PROXIES=f"{PROXY}/32,{INNER_PROXIES}",
        METRICS_ALLOWED_NETWORKS=f"{PROXY}/32",
    )
    log = tmp_path_factory.mktemp("proxies") / "gunicorn.log"
    with launch.gunicorn(env, config=GunicornConfig(workers=2), log=log) as server:
        yield server.port


def log_in_from(port: int, source: str, password: str, forwarded: str | None = None) -> Answer:
    """The admin login form, filled in and posted from ``source`` (its CSRF token fetched from
    there too), with ``forwarded`` as X-Forwarded-For on the POST."""
    page = send(port, source=source, method="GET", path=LOGIN)
    cookie = page.headers.get_all("Set-Cookie") or []
    token = re.search(r"csrftoken=([^;]+)", " ".join(cookie))
    assert token, cookie
    form = {"username": "boss", "password": password, "csrfmiddlewaretoken": token[1]}
    headers = {
        "Content-Type": "application/x-www-form-urlencoded",
        "Cookie": f"csrftoken={token[1]}",
    }
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    return send(port, source=source, path=LOGIN, body=urlencode(form).encode(), headers=headers)


@through_gunicorn
@pytest.mark.slow
def test_a_client_around_the_proxy_is_one_client_to_the_login_limit(app: int) -> None:
    get_user_model().objects.create_superuser("boss", "boss@example.com", PASSWORD)
    around = a_loopback_address()
    failures = [
        log_in_from(app, around, "wrong", forwarded=an_address()).status
        for _ in range(GUNICORN_LIMIT)
    ]
    assert failures == [200] * (GUNICORN_LIMIT - 1) + [429]
    assert log_in_from(app, around, PASSWORD, forwarded=an_address()).status == 429
    assert set(AccessAttempt.objects.values_list("ip_address", flat=True)) == {around}

    # From the trusted proxy, each forwarded address counts on its own: nobody is locked out.
    forwarded = [an_address() for _ in range(GUNICORN_LIMIT)]
    statuses = {log_in_from(app, PROXY, "wrong", forwarded=f).status for f in forwarded}
    assert statuses == {200}
    assert log_in_from(app, PROXY, PASSWORD, forwarded=an_address()).status == 302
    attempts = set(AccessAttempt.objects.values_list("ip_address", flat=True))
    assert attempts == {around, *forwarded}


@through_gunicorn
@pytest.mark.slow
def test_trusted_entries_are_skipped_from_the_right(app: int) -> None:
    """The login limit files each failure under the address the rule gives: the first entry
    from the right that is not a trusted proxy (nginx's real_ip_recursive)."""
    get_user_model().objects.create_superuser("boss", "boss@example.com", PASSWORD)
    cases = {
        # The client, then a trusted inner proxy: skipped.
        "198.51.100.9, 192.0.2.7": "198.51.100.9",
        "6.6.6.6, 198.51.100.10, 192.0.2.7, 192.0.2.8": "198.51.100.10",
        # An untrusted entry is the client, whatever trusted address the client put before it.
        "192.0.2.9, 198.51.100.11": "198.51.100.11",
        # Every entry a trusted proxy: the farthest.
        "192.0.2.20, 192.0.2.7": "192.0.2.20",
        # An entry that is not an address: the peer.
        "198.51.100.12, garbage, 192.0.2.7": PROXY,
    }
    for forwarded, expected in cases.items():
        AccessAttempt.objects.all().delete()
        assert log_in_from(app, PROXY, "wrong", forwarded=forwarded).status == 200, forwarded
        filed = list(AccessAttempt.objects.values_list("ip_address", flat=True))
        assert filed == [expected], forwarded


@through_gunicorn
@pytest.mark.slow
def test_the_metrics_allow_list_judges_the_client_not_its_header(app: int) -> None:
    def metrics(source: str, forwarded: str | None = None) -> int:
        headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
        return send(app, source=source, method="GET", path="/metrics", headers=headers).status

    around = "127.0.0.2"
    assert metrics(PROXY) == 200
    assert metrics(around) == 403
    # Around the proxy, naming an allowed address (or one after another) changes nothing.
    assert metrics(around, forwarded=PROXY) == 403
    assert metrics(around, forwarded=f"203.0.113.5, {PROXY}") == 403
    # Through the proxy, the client it names is judged.
    assert metrics(PROXY, forwarded=PROXY) == 200
    assert metrics(PROXY, forwarded=around) == 403
    assert metrics(PROXY, forwarded=f"{PROXY}, 203.0.113.5") == 403
