"""What the web process logs, and mails, when clients send what they should not: a real
gunicorn (two workers, multiprocess metrics) on this run's database, with ``DJANGO_ADMINS``
set and email pointed at a real SMTP server, as a production deployment with an alert
address is. A refused Host is one WARNING line and a count per request, never a mail; a
server error is never mailed either; a Host built to make a backtracking mask take seconds is
answered in milliseconds; the access log keeps no query string."""

from __future__ import annotations

import http.client
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from stack import launch
from stack.launch import GunicornConfig
from stack.net import HOST, wait_until
from stack.process import ROOT, Process
from stack.smtp import SmtpServer
from tests.helpers.metrics import METRICS_URL, Samples, parse, value
from tests.helpers.processes import worker_env
from tests.helpers.stripe import WEBHOOK_URL
from tests.helpers.urls import SERVER_ERROR_PATH

ADMINS = "ops@example.com"
REFUSED = "invoicing_http_suspicious_requests_total"


@dataclass(frozen=True)
class Web:
    server: Process
    env: dict[str, str]
    access_log: Path

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> int:
        """The status of a GET of ``path`` on a new connection (``Host`` is the server's own
        address unless ``headers`` give another)."""
        connection = http.client.HTTPConnection(HOST, self.server.port, timeout=10)
        try:
            connection.request("GET", path, headers=dict(headers or {}))
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()

    def scrape(self) -> Samples:
        connection = http.client.HTTPConnection(HOST, self.server.port, timeout=10)
        try:
            connection.request("GET", METRICS_URL)
            response = connection.getresponse()
            assert response.status == 200
            return parse(response.read().decode())
        finally:
            connection.close()


@pytest.fixture(scope="module")
def smtp_server() -> Iterator[SmtpServer]:
    with SmtpServer() as server:
        yield server


@pytest.fixture(scope="module")
def web(
    django_db_setup: None, smtp_server: SmtpServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Web]:
    """gunicorn as compose runs it (``-c gunicorn.conf.py``, an access log), with the
    alert address set and email going to ``smtp_server``; its URLs have a view that fails."""
    directory = tmp_path_factory.mktemp("web-logs")
    env = worker_env(
        smtp_server.port,
        {"ROOT_URLCONF": "tests.helpers.urls"},
        DJANGO_ADMINS=ADMINS,
        PROMETHEUS_MULTIPROC_DIR=str(directory / "metrics"),
    )
    access_log = directory / "access.log"
    with launch.gunicorn(
        env,
        args=("-c", "gunicorn.conf.py", "core.wsgi", f"--access-logfile={access_log}"),
        config=GunicornConfig(workers=2),
        log=directory / "gunicorn.log",
        ready_path=WEBHOOK_URL,
    ) as server:
        yield Web(server=server, env=env, access_log=access_log)


@pytest.mark.slow
def test_a_host_scan_is_one_warning_line_and_a_count_per_request_and_never_mailed(
    web: Web, smtp_server: SmtpServer
) -> None:
    before, logged = web.scrape(), len(web.server.log_text())
    # Names that are valid but not ours, and names that are not host names at all: both are
    # Django's DisallowedHost.
    hosts = [f"scan-{i}.example.net" for i in range(25)] + [f"bad_{i}@x" for i in range(25)]
    assert {web.get("/", {"Host": host}) for host in hosts} == {400}
    assert web.get(SERVER_ERROR_PATH) == 500

    # AdminEmailHandler would have sent each synchronously, before the answer.
    assert not smtp_server.handler.wait_for(1, timeout=1)
    assert smtp_server.handler.received() == []
    log = web.server.log_text()[logged:]
    refused = [line for line in log.splitlines() if "Invalid HTTP_HOST header" in line]
    assert len(refused) == len(hosts), log[-3000:]
    assert all(" WARNING django.security.DisallowedHost " in line for line in refused)
    assert "Traceback" not in log.partition("Internal Server Error")[0]  # the 500's comes last
    assert "Bad Request" not in log
    assert log.count(f"ERROR django.request Internal Server Error: {SERVER_ERROR_PATH}") == 1
    after = web.scrape()
    counted = value(after, REFUSED, kind="DisallowedHost") - value(
        before, REFUSED, kind="DisallowedHost"
    )
    assert counted == len(hosts)

    # The same environment does mail the admins, when something means to: the 0 above is the
    # logging configuration's, not an SMTP server out of reach.
    result = subprocess.run(
        [sys.executable, "manage.py", "sendtestemail", "--admins"],
        cwd=ROOT,
        env=web.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert smtp_server.handler.wait_for(1, timeout=10)
    assert [m.rcpt_tos for m in smtp_server.handler.received()] == [[ADMINS]]


@pytest.mark.slow
def test_a_host_of_8_kb_ending_in_an_at_sign_is_answered_within_50_ms(web: Web) -> None:
    """Django's DisallowedHost line repeats the Host; a mask that backtracks spends the square
    of its length on it (0.6 s and more at 8 KB), in the worker, before the answer. gunicorn
    takes header fields up to 8190 bytes: this one reaches Django."""
    host = {"Host": "a" * 7999 + "@"}
    for _ in range(8):  # every worker warm, and past its first answer of this kind
        assert web.get("/", host) == 400
    times = []
    for _ in range(5):
        started = time.perf_counter()
        assert web.get("/", host) == 400
        times.append(time.perf_counter() - started)
    assert statistics.median(times) < 0.050, times
    assert "a" * 7999 + "@" in web.server.log_text()  # logged in full, once masked


@pytest.mark.slow
def test_the_access_log_keeps_no_query_string(web: Web) -> None:
    search = "/admin/invoicing/invoice/?q=jenny.rosen%40example.com"
    status = web.get(
        "/admin/?q=jenny.rosen@example.com",
        {"Referer": f"http://{HOST}{search}", "User-Agent": "access-log-test"},
    )
    assert status == 302  # to the login page

    def line() -> str:
        text = web.access_log.read_text() if web.access_log.exists() else ""
        return next((ln for ln in text.splitlines() if "access-log-test" in ln), "")

    assert wait_until(line, timeout=10)
    assert f'"GET /admin/ HTTP/1.1" {status} ' in line()
    assert line().endswith('"-" "access-log-test"')  # no Referer
    text = web.access_log.read_text()
    assert "jenny" not in text
    assert "q=" not in text
