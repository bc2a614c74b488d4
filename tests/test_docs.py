"""The docs stay true: every variable the settings or the edge read is in
docs/configuration.md, and every variable documented there is read by one of them."""

from __future__ import annotations

import re

from stack.nginx import setting_names
from stack.process import ROOT

# Read by a library rather than by our settings (prometheus-client's multiprocess mode).
READ_BY_LIBRARIES = {"PROMETHEUS_MULTIPROC_DIR"}


def settings_variables() -> set[str]:
    text = (ROOT / "core" / "settings.py").read_text()
    read = re.findall(r"env(?:\.\w+)?\(\s*\"([A-Z][A-Z0-9_]+)\"", text)
    secrets = re.findall(r"_secret\(\s*\"([A-Z][A-Z0-9_]+)\"", text)
    return set(read) | set(secrets)


def edge_variables() -> set[str]:
    return set(setting_names())  # what deploy/nginx/render.sh reads


def documented_variables() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", text, re.MULTILINE)
    return {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}


def test_every_variable_read_is_documented_and_every_documented_one_is_read() -> None:
    read = settings_variables() | edge_variables() | READ_BY_LIBRARIES
    documented = documented_variables()
    assert {"DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET", "WEBHOOK_ALLOWED_SOURCES"} <= read
    assert sorted(read - documented) == [], "read but not in docs/configuration.md"
    assert sorted(documented - read) == [], "in docs/configuration.md but read by nothing"
