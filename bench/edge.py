"""nginx in front of gunicorn, configured from ``deploy/nginx`` exactly as compose.yaml's ``edge``
service is: ``render.sh`` renders ``default.conf.template`` from the settings given (the
template's header says what the edge guarantees).

Needs the ``nginx`` binary (Debian: ``apt-get install nginx-light``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from bench.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "nginx" / "default.conf.template"
RENDERER = ROOT / "deploy" / "nginx" / "render.sh"

Settings = Mapping[str, str | int]


class RenderError(ValueError):
    """render.sh refused the settings; the message is its own."""


def _render(settings: Settings, output: str) -> str:
    # Only the settings given (and PATH): nothing leaks in from this process's environment.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update({name: str(value) for name, value in settings.items()})
    result = subprocess.run(
        ["sh", str(RENDERER), str(TEMPLATE), output],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
    return result.stdout


def render(settings: Settings, output: Path) -> None:
    """Write the configuration render.sh makes of ``settings`` to ``output``."""
    _render(settings, str(output))


def rendered(settings: Settings) -> str:
    """The configuration render.sh makes of ``settings``."""
    return _render(settings, "-")


def setting_names() -> list[str]:
    """The settings render.sh reads (``render.sh --settings``)."""
    result = subprocess.run(
        ["sh", str(RENDERER), "--settings"], capture_output=True, text=True, check=True
    )
    return result.stdout.split()


def _nginx() -> str:
    return shutil.which("nginx") or "/usr/sbin/nginx"


@contextlib.contextmanager
def _prefix(settings: Settings) -> Iterator[Path]:
    """A directory holding nginx.conf (a minimal main configuration, like the nginx image's)
    that includes the rendered server configuration."""
    prefix = Path(tempfile.mkdtemp(prefix="edge-"))
    try:
        prefix.chmod(0o755)
        render(settings, prefix / "server.conf")
        (prefix / "nginx.conf").write_text(
            f"""daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    include {prefix}/server.conf;
}}
"""
        )
        yield prefix
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def nginx_check(settings: Settings) -> None:
    """Render ``settings`` and have nginx check the result (``nginx -t``); raise with nginx's
    message if it refuses it."""
    with _prefix(settings) as prefix:
        result = subprocess.run(
            [_nginx(), "-t", "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())


@contextlib.contextmanager
def edge(
    upstream_port: int,
    *,
    rate: int,
    burst: int,
    in_flight: int,
    settings: Settings | None = None,
) -> Iterator[int]:
    """Run nginx on a free local port in front of ``127.0.0.1:upstream_port``, admitting
    ``rate`` webhooks per second in all (``burst`` at once) and ``in_flight`` at a time; any
    other render.sh setting in ``settings`` (the per-address ones default to half of these).
    Yield its port."""
    port = free_port()
    every = {
        "WEBHOOK_EDGE_RATE": rate,
        "WEBHOOK_EDGE_BURST": burst,
        "WEBHOOK_EDGE_CONNECTIONS": in_flight,
        "APP_UPSTREAM": f"127.0.0.1:{upstream_port}",
        "EDGE_LISTEN": f"127.0.0.1:{port}",
        "EDGE_CAPACITY_LISTEN": f"127.0.0.1:{free_port()}",
        **(settings or {}),
    }
    with _prefix(every) as prefix:
        process = subprocess.Popen(
            [_nginx(), "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    error = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"nginx did not start: {error}")
                time.sleep(0.05)
            yield port
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGQUIT)  # graceful: finish what is in flight
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
            if process.stderr is not None:
                process.stderr.close()
