"""gunicorn's configuration, read by ``gunicorn core.wsgi`` started from the project's directory
(gunicorn's default ``./gunicorn.conf.py``; elsewhere ``-c /path/to/gunicorn.conf.py``).

Read in the master before anything forks: settings that do not load stop it with one line
(``core.startup``), not a traceback in every worker.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from django.conf import settings

from core.startup import settings_load_or_exit

__all__ = [
    "access_log_format",
    "child_exit",
    "forwarded_allow_ips",
    "on_starting",
    "secure_scheme_headers",
]

settings_load_or_exit()

# Whether a request came over HTTPS: gunicorn sets the request's scheme from X-Forwarded-Proto
# for a peer in TRUSTED_PROXIES alone (none by default, where gunicorn's own default trusts
# loopback), and from no other header; Django reads the scheme gunicorn set (no
# SECURE_PROXY_SSL_HEADER). A plain-HTTP client reaching gunicorn cannot pass as HTTPS.
forwarded_allow_ips = ",".join(
    str(ipaddress.ip_network(entry, strict=False))
    for entry in settings.ASYNCWORK["TRUSTED_PROXIES"]
)
secure_scheme_headers = {"X-FORWARDED-PROTO": "https"}

# gunicorn's combined-log shape without query strings or Referer: an admin search's query is
# the email address searched for.
access_log_format = '%(h)s %(l)s %(u)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s "-" "%(a)s"'


def on_starting(server: Any) -> None:
    """Before any worker forks: an earlier run's counts must not add to this one's."""
    from asyncwork.contrib.monitoring.metrics import multiprocess_dir_reset

    multiprocess_dir_reset()


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's counters stay in the sum; only live gauges of its pid are dropped."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
