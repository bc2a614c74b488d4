"""The edge's nginx configuration, made from ``deploy/nginx`` exactly as compose.yaml's ``edge``
service makes it: ``render.sh`` renders ``default.conf.template`` from the settings given, and
nothing else of the caller's environment (the template's header says what the edge
guarantees). ``launch.edge`` runs what this renders.

Needs the ``nginx`` binary for ``nginx_check`` and the edge itself (Debian: ``apt-get install
nginx-light``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from stack.process import ROOT

TEMPLATE = ROOT / "deploy" / "nginx" / "default.conf.template"
RENDERER = ROOT / "deploy" / "nginx" / "render.sh"

Settings = Mapping[str, object]


class RenderError(ValueError):
    """render.sh (or ``nginx -t``) refused the settings; the message is its own."""


def nginx_binary() -> str | None:
    """Where the nginx program is, or None when it is not installed."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


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


def prefix_make(settings: Settings) -> Path:
    """A new directory (readable by nginx's unprivileged workers) holding nginx.conf, a
    minimal main configuration like the nginx image's, which includes the server
    configuration rendered from ``settings``; the access log is ``access.log`` there unless
    ``settings`` say otherwise. The caller removes it."""
    prefix = Path(tempfile.mkdtemp(prefix="edge-"))
    try:
        prefix.chmod(0o755)
        render({"EDGE_ACCESS_LOG": prefix / "access.log", **settings}, prefix / "server.conf")
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
    except BaseException:
        shutil.rmtree(prefix, ignore_errors=True)
        raise
    return prefix


def nginx_argv(prefix: Path, *options: str) -> list[str]:
    """The nginx command line for the configuration in ``prefix``: the one place it is built."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    return [binary, *options, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]


def nginx_check(settings: Settings) -> None:
    """Render ``settings`` and have nginx check the result (``nginx -t``); raise
    ``RenderError`` with nginx's message if it refuses it."""
    prefix = prefix_make(settings)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, prefix, ignore_errors=True)
        result = subprocess.run(
            nginx_argv(prefix, "-t"), capture_output=True, text=True, timeout=30, check=False
        )
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
