"""A client that says which address it sends from: Linux routes all of 127.0.0.0/8 to the
loopback interface, so a test tells senders apart (a trusted proxy, a client reaching the
application around it) by the loopback address each connects from."""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stack.net import HOST
from tests.helpers.stripe import WEBHOOK_URL


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def from_edge(self) -> bool:
        """nginx answered itself: Django's SecurityMiddleware puts X-Content-Type-Options on
        every response the application makes (WhiteNoise's static files included), and nginx's
        own answers have none."""
        return "X-Content-Type-Options" not in self.headers


def send(
    port: int,
    *,
    source: str = HOST,
    method: str = "POST",
    path: str = WEBHOOK_URL,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    timeout: float = 10,
) -> Answer:
    """One request to ``HOST``:``port`` on a new connection from ``source``."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request(method, path, body=body or None, headers=dict(headers or {}))
        response = connection.getresponse()
        return Answer(response.status, response.headers, response.read())
    finally:
        connection.close()
