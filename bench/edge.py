"""nginx in front of gunicorn, configured from ``deploy/nginx/default.conf.template`` exactly as
compose.yaml's ``edge`` service is: the webhook's admission control moved where refusing costs
nothing (see the template's header).

Needs the ``nginx`` binary (Debian: ``apt-get install nginx-light``).
"""

from __future__ import annotations

import contextlib
import re
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


def rendered(settings: Mapping[str, str | int]) -> str:
    """The template with its ``${NAME}`` settings filled in, as the nginx image's envsubst does
    (only those names; nginx's own ``$variables`` stay). A setting missing is an error."""
    text = TEMPLATE.read_text()
    wanted = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)\}", text))
    missing = wanted - set(settings)
    if missing:
        raise ValueError(f"settings missing for {TEMPLATE.name}: {sorted(missing)}")
    for name in wanted:
        text = text.replace("${" + name + "}", str(settings[name]))
    return text


@contextlib.contextmanager
def edge(upstream_port: int, *, rate: int, burst: int, in_flight: int) -> Iterator[int]:
    """Run nginx on a free local port in front of ``127.0.0.1:upstream_port``, admitting
    ``rate`` webhooks per second (``burst`` at once) and ``in_flight`` at a time; yield its
    port."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    prefix = Path(tempfile.mkdtemp(prefix="edge-"))
    prefix.chmod(0o755)
    server = rendered(
        {
            "WEBHOOK_EDGE_RATE": rate,
            "WEBHOOK_EDGE_BURST": burst,
            "WEBHOOK_EDGE_CONNECTIONS": in_flight,
            "APP_UPSTREAM": f"127.0.0.1:{upstream_port}",
            "EDGE_LISTEN": f"127.0.0.1:{port}",
        }
    )
    (prefix / "server.conf").write_text(server)
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
    process = subprocess.Popen(
        [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
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
        shutil.rmtree(prefix, ignore_errors=True)
