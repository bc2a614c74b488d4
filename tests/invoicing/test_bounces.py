"""The email tracking webhook as strangers meet it: a real gunicorn sending through Postmark
(``EMAIL_BACKEND`` anymail's Postmark backend, ``ANYMAIL_WEBHOOK_SECRET`` set), and anonymous
posts to every tracking URL anymail has. Only the configured provider's is served: every other
is 404 with the reason, never a 500; the configured one refuses a post without its secret with
400, one WARNING line and a count, never a traceback."""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Iterator, Mapping

import pytest
from anymail import urls as anymail_urls
from django.urls import URLPattern

from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST
from stack.process import Process
from tests.helpers.metrics import METRICS_URL, Samples, parse, value
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.slow

WEBHOOK_SECRET = "postmark:webhook-secret-for-tests"
REFUSED = "invoicing_http_suspicious_requests_total"
KIND = "AnymailWebhookValidationFailure"

# Every provider anymail has a tracking webhook for: ``<provider>/tracking/``.
PROVIDERS = sorted(
    str(p.pattern).partition("/")[0]
    for p in anymail_urls.urlpatterns
    if isinstance(p, URLPattern) and (p.name or "").endswith("_tracking_webhook")
)


def _tracking_url(provider: str) -> str:
    return f"/webhooks/email/{provider}/tracking/"


def _post(
    server: Process, path: str, headers: Mapping[str, str] | None = None
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(HOST, server.port, timeout=10)
    try:
        body = json.dumps({"RecordType": "Bounce", "Email": "x@example.com"})
        connection.request(
            "POST", path, body, {"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _scrape(server: Process) -> Samples:
    connection = http.client.HTTPConnection(HOST, server.port, timeout=10)
    try:
        connection.request("GET", METRICS_URL)
        response = connection.getresponse()
        assert response.status == 200
        return parse(response.read().decode())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def web(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    directory = tmp_path_factory.mktemp("tracking")
    env = worker_env(
        0,
        EMAIL_BACKEND="anymail.backends.postmark.EmailBackend",
        ANYMAIL_POSTMARK_SERVER_TOKEN="server-token",
        ANYMAIL_WEBHOOK_SECRET=WEBHOOK_SECRET,
        PROMETHEUS_MULTIPROC_DIR=str(directory / "metrics"),
    )
    with launch.gunicorn(
        env, config=GunicornConfig(workers=2), log=directory / "gunicorn.log"
    ) as server:
        yield server


def test_only_the_configured_providers_tracking_webhook_is_served(web: Process) -> None:
    assert "postmark" in PROVIDERS
    assert len(PROVIDERS) > 10
    for provider in PROVIDERS:
        if provider == "postmark":
            continue
        status, body = _post(web, _tracking_url(provider))
        assert (status, json.loads(body)) == (
            404,
            {"error": "no email tracking webhook here for this provider (EMAIL_BACKEND)"},
        ), provider
    assert _post(web, _tracking_url("no-such-provider"))[0] == 404
    assert "Traceback" not in web.log_text()


def test_a_post_failing_the_providers_verification_is_one_warning_line_and_a_count(
    web: Process,
) -> None:
    before, logged = _scrape(web), len(web.log_text())
    wrong = "Basic " + base64.b64encode(b"postmark:not-the-secret").decode()
    attempts = [{}, {"Authorization": wrong}] * 5
    assert {_post(web, _tracking_url("postmark"), headers)[0] for headers in attempts} == {400}

    log = web.log_text()[logged:]
    refused = [line for line in log.splitlines() if KIND in line]
    assert len(refused) == len(attempts), log[-3000:]
    assert all(f" WARNING django.security.{KIND} " in line for line in refused)
    assert "Traceback" not in log
    assert " ERROR " not in log
    assert value(_scrape(web), REFUSED, kind=KIND) - value(before, REFUSED, kind=KIND) == len(
        attempts
    )

    # The provider itself, with the secret, is served (its event names no email of ours).
    right = "Basic " + base64.b64encode(WEBHOOK_SECRET.encode()).decode()
    assert _post(web, _tracking_url("postmark"), {"Authorization": right})[0] == 200
