"""Django's PostgreSQL backend with a cheaper health check.

``CONN_HEALTH_CHECKS`` has Django ask ``is_usable()`` before a persistent connection's first
use in each request and each Celery task; Django's own answer is a ``SELECT 1``, one round trip
to the server per webhook and per email. A server that ends a connection (a restart, a
``pg_terminate_backend``, a killed backend) sends its ``FATAL`` and closes the socket, so the
socket becomes readable; an idle connection that is fine has nothing to read (this project
never ``LISTEN``s on Django's connections). So: nothing to read, usable, with no round trip;
anything to read, Django's ``SELECT 1`` decides. What no check before use can see (a server
gone without closing the socket) fails the request's own statement instead, as it would fail a
``SELECT 1`` that came a moment earlier.
"""

from __future__ import annotations

import select
from typing import Any

from django.db.backends.postgresql import base

# psycopg prepares a statement run this many times on one connection by itself: never, in
# effect. Django's cursors bind on the client and never prepare; a statement is prepared only
# where a caller asks (``asyncwork.db.prepared_cursor``). Django's default, None, refuses even
# that (it keeps transaction-pooling proxies working; behind a PgBouncer in transaction mode,
# set ``max_prepared_statements``, PgBouncer 1.21+).
PREPARE_ONLY_WHEN_ASKED = 2**31 - 1


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self) -> dict[str, Any]:
        params: dict[str, Any] = super().get_connection_params()
        if "prepare_threshold" not in self.settings_dict["OPTIONS"]:
            params["prepare_threshold"] = PREPARE_ONLY_WHEN_ASKED
        return params

    def is_usable(self) -> bool:
        connection = self.connection
        if connection is None or connection.closed or connection.broken:
            return False
        try:
            poller = select.poll()
            poller.register(connection.fileno(), select.POLLIN | select.POLLPRI)
            ready = poller.poll(0)
        except (OSError, ValueError):
            return False
        if not ready:
            return True
        # A notice, or the server's goodbye: ask it.
        return bool(super().is_usable())
