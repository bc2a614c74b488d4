"""Static files as deployed (core/settings.py, Static files): gunicorn on the production
settings serves the admin's stylesheet itself (WhiteNoise), under the hashed name the image
build's collectstatic gave it, compressed and cacheable for good, and the nginx edge passes it
through unchanged. With DEBUG on nothing needs collecting.

The browser test (tests/test_browser.py) checks that the pages are styled in Chromium."""

from __future__ import annotations

import gzip
import http.client
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import brotli
import pytest
from django.contrib import admin as django_admin
from django.test import Client

from stack import launch
from stack.process import Process
from tests.helpers.web import hashed_name

BASE_CSS = "admin/css/base.css"
# WhiteNoise's answer for a name carrying its content's hash: it never changes, cache it for
# ten years without revalidating.
FOREVER = "max-age=315360000, public, immutable"


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes  # as sent: still compressed when Content-Encoding says so


def get(port: int, path: str, *, accept_encoding: str = "identity") -> Answer:
    """One GET on a new connection; the body exactly as it came (http.client decodes nothing)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers={"Accept-Encoding": accept_encoding})
        response = connection.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        connection.close()


def assert_served_as_deployed(port: int, static_root: Path) -> None:
    """The hashed base.css: 200, cacheable for good, and the same bytes whether sent plain, as
    Brotli or as gzip, each chosen by Accept-Encoding."""
    hashed = hashed_name(static_root, BASE_CSS)
    assert re.fullmatch(r"admin/css/base\.[0-9a-f]{12}\.css", hashed), hashed
    css = (static_root / hashed).read_bytes()
    assert b"--header-bg" in css

    plain = get(port, f"/static/{hashed}")
    assert plain.status == 200
    assert plain.headers["Content-Type"].startswith("text/css")
    assert plain.headers["Cache-Control"] == FOREVER
    assert "Content-Encoding" not in plain.headers
    assert plain.body == css

    for encoding, decompress in (("br", brotli.decompress), ("gzip", gzip.decompress)):
        compressed = get(port, f"/static/{hashed}", accept_encoding=f"{encoding}, deflate")
        assert compressed.status == 200, encoding
        assert compressed.headers["Content-Encoding"] == encoding
        assert compressed.headers["Cache-Control"] == FOREVER
        assert "Accept-Encoding" in compressed.headers["Vary"]  # caches keep both apart
        assert len(compressed.body) < len(css) / 3, encoding
        assert decompress(compressed.body) == css, encoding


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_gunicorn_serves_the_admin_stylesheet_hashed_compressed_and_cacheable(
    production_web: Process, collected_static: Path
) -> None:
    port = production_web.port
    assert_served_as_deployed(port, collected_static)

    # Pages name the hashed file, so a new release's stylesheet is a new URL.
    login = get(port, "/admin/login/")
    assert login.status == 200
    hashed = hashed_name(collected_static, BASE_CSS)
    assert f'href="/static/{hashed}"'.encode() in login.body

    # The plain name is served too, for anything that asks for it, but only briefly cached.
    unhashed = get(port, f"/static/{BASE_CSS}")
    assert unhashed.status == 200
    assert unhashed.headers["Cache-Control"] == "max-age=60, public"
    assert unhashed.body == (collected_static / BASE_CSS).read_bytes()

    # A file that does not exist is Django's 404, not a 500.
    assert get(port, "/static/admin/css/no-such-file.css").status == 404


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_edge_passes_static_files_through(
    production_web: Process, collected_static: Path
) -> None:
    """compose's published port is nginx's: the static files come through its catch-all
    location from gunicorn unchanged, compression and cache headers included."""
    with launch.edge(production_web.port, rate=50, burst=10, in_flight=6) as nginx:
        port = nginx.port
        assert_served_as_deployed(port, collected_static)
        assert get(port, "/admin/login/").status == 200


def test_with_debug_on_nothing_needs_collecting(
    client: Client, settings: Any, tmp_path: Path
) -> None:
    """Development (DJANGO_DEBUG=1, runserver or gunicorn): production's storage, no
    collectstatic, and an empty STATIC_ROOT; pages name the files plainly and WhiteNoise finds
    each in its app."""
    settings.DEBUG = True
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    }
    settings.STATIC_ROOT = tmp_path / "never-collected"
    del settings.WHITENOISE_USE_FINDERS  # WhiteNoise's own default: on with DEBUG

    login = client.get("/admin/login/")
    assert login.status_code == 200
    assert b'href="/static/admin/css/base.css"' in login.content

    served = client.get(f"/static/{BASE_CSS}")
    assert served.status_code == 200
    in_the_app = Path(django_admin.__file__).parent / "static" / BASE_CSS
    # A static file is a streamed response; the test client's response type in the stubs is not.
    assert b"".join(served.streaming_content) == in_the_app.read_bytes()  # type: ignore[attr-defined]
