"""The project's URLs plus a view that fails as a bug would: the ``ROOT_URLCONF`` of a real
gunicorn (``worker_env(settings=...)``), for the tests of what a server error (500) does in
production (logged, never mailed)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import path

from core.urls import urlpatterns as base

SERVER_ERROR_PATH = "/tests/server-error/"


def server_error(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("a bug in a view")


urlpatterns = [*base, path(SERVER_ERROR_PATH.removeprefix("/"), server_error)]
