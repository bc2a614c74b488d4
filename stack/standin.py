"""What every stand-in of a provider's HTTP API shares (``stack.stripe_api``,
``stack.postmark``): a threaded HTTP server on a thread of the caller's process, on a free
loopback port, started and stopped as a context manager, able to hang a request past the
client's timeout, and answering JSON."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, Self

from stack.net import HOST


class StandIn:
    """A stand-in; ``start()`` returns once it listens, ``stop()`` ends it (and any hang). A
    subclass names its request ``handler`` (a ``JsonHandler``) and its thread."""

    handler: ClassVar[type[BaseHTTPRequestHandler]]
    thread_name: ClassVar[str] = "stand-in"

    def __init__(self, *, hang_seconds: float) -> None:
        self.hang_seconds = hang_seconds
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._server: StandInServer | None = None

    @property
    def address(self) -> str:
        """``http://host:port``, once started."""
        assert self._server is not None, "not started"
        return f"http://{HOST}:{self._server.server_address[1]}"

    def start(self) -> Self:
        server = StandInServer((HOST, 0), self.handler)
        server.api = self
        self._server = server
        threading.Thread(target=server.serve_forever, name=self.thread_name, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def hang(self) -> None:
        """Hold the request unanswered for ``hang_seconds`` (or until stopped)."""
        self._stopped.wait(self.hang_seconds)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class StandInServer(ThreadingHTTPServer):
    api: Any  # the StandIn it serves


class JsonHandler(BaseHTTPRequestHandler):
    """Answers JSON, quietly: the stand-in's own records are what a test reads."""

    def send_json(
        self, status: int, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""
