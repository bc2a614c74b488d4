"""gunicorn's configuration: ``gunicorn -c python:core.gunicorn_conf core.wsgi``, and plain
``gunicorn core.wsgi`` from the project's directory (``./gunicorn.conf.py`` reuses this).

gunicorn reads it in the master, before it logs, binds or forks anything: settings that do not
load stop it there with one line (``core.startup``), rather than in every worker with a
traceback and the arbiter's "Worker failed to boot". Whether a request came over HTTPS is
Django's to decide, from ``TRUSTED_PROXIES`` (core/settings.py), not gunicorn's. The access log
holds no query string. Its hooks serve prometheus-client's multiprocess mode; without
``PROMETHEUS_MULTIPROC_DIR`` they do nothing.
"""

from __future__ import annotations

import os
from typing import Any

from core.startup import settings_load_or_exit

__all__ = ["access_log_format", "child_exit", "on_starting", "secure_scheme_headers"]

settings_load_or_exit()

# gunicorn would otherwise set the scheme to https itself for X-Forwarded-Proto: https from any
# peer in forwarded_allow_ips (loopback by default, and every Unix-socket peer): behind a local
# proxy that passes the client's header on, a plain-HTTP client could pass as HTTPS whatever
# TRUSTED_PROXIES says. Without it, Django alone reads the header, and only from a peer in
# TRUSTED_PROXIES (operators.http.ForwardedProtoMiddleware).
secure_scheme_headers: dict[str, str] = {}

# The access log (``--access-logfile``: compose and the Docker image write it to stdout) in
# gunicorn's default, combined-log shape, without query strings: an admin search's is the
# address searched for (``?q=jenny@example.com``), and the pages after it carry it in their
# Referer. The request line is method, path and protocol; the Referer, which no gunicorn field
# gives without its query, is left out ("-").
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s "-" "%(a)s"'


def on_starting(server: Any) -> None:
    """In the master, before any worker forks: counts of an earlier run must not be added to
    this one's."""
    from asyncwork.metrics import multiprocess_dir_reset

    multiprocess_dir_reset()


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's counters stay in the sum; only live gauges of its pid are dropped."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
