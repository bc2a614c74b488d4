"""docs/reference/settings.md, from the declarations in the code.

An operator setting is declared once: in ``core/settings.py`` as ``setting(NAME, default,
reason)`` (a secret as ``_secret(NAME, ..., reason=...)``, a key of the machinery's
``ASYNCWORK`` as ``machinery(NAME, type, reason)``, its default the machinery's, from
``asyncwork/settings.py``), under the settings file's section comment (``# --- Email ---``); in
``deploy/nginx/render.sh``'s header as ``NAME  default: reason``
for the edge. This reads both (without importing the settings: the defaults shown are the code
as written) and writes the reference. ``tests/core/test_configuration_doc.py`` fails when the
file and the code disagree.

    .venv/bin/python -m scripts.configuration_doc          # rewrite docs/reference/settings.md
    .venv/bin/python -m scripts.configuration_doc --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from typing import NamedTuple

from asyncwork.settings import SETTINGS as MACHINERY
from stack.process import ROOT

SETTINGS = ROOT / "core" / "settings.py"
RENDER = ROOT / "deploy" / "nginx" / "render.sh"
DOC = ROOT / "docs" / "reference" / "settings.md"

# Set by the operator, not declared by ``setting(...)``: read by a library, or by pattern.
LIBRARY = {
    "ANYMAIL_<NAME>": (
        "unset",
        'each becomes ANYMAIL["<NAME>"] for django-anymail (core/settings.py '
        "anymail_from_environment), e.g. ANYMAIL_POSTMARK_SERVER_TOKEN; a JSON value (a "
        "number, true or false, a list) is read as JSON, any other as text. An "
        "ANYMAIL_<ESP>_API_URL, with DJANGO_DEBUG off, is https on the provider's own domain "
        "(core/providers.py) unless PROVIDER_API_ALLOWED_ORIGINS lists its origin",
    ),
    "ANYMAIL_WEBHOOK_SECRET": (
        "unset: the tracking webhooks are off (404)",
        "user:password, the tracking webhooks' basic auth (a JSON list of them while one is "
        "rolled); a password shorter than 24 characters stops start-up: make one with "
        "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
    ),
    "PROMETHEUS_MULTIPROC_DIR": (
        "unset",
        "read by prometheus-client: an empty directory per process group (web, each worker) "
        "where its processes share their counters",
    ),
}

INTRO = """# Settings

Every setting an operator can set, its default and why it exists. Generated from the
declarations in `core/settings.py` (`setting(NAME, default, reason)`) and in
`deploy/nginx/render.sh`'s header by `python -m scripts.configuration_doc`; do not edit by
hand. A value out of range stops start-up with one line naming it (`Configuration error:
...`), never a traceback. Every other number is a named constant in the module that uses it.

**Production is the default.** With `DJANGO_DEBUG` unset, `manage.py`, gunicorn and
`celery -A core worker|beat` refuse to start without `DJANGO_SECRET_KEY` and
`STRIPE_WEBHOOK_SECRET`, naming each missing one. On a development machine,
`export DJANGO_DEBUG=1` gives development secrets and plain HTTP (never in production: its
secrets are public).
"""


class Setting(NamedTuple):
    section: str
    name: str
    default: str
    reason: str


def _default(node: ast.expr) -> str:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return f"`{ast.unparse(node)}`"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("", []):
        return "empty"
    if isinstance(value, list):
        return f"`{','.join(value)}`"
    return f"`{value}`"


def application() -> list[Setting]:
    """The ``setting(...)`` and ``_secret(...)`` calls of core/settings.py, in file order."""
    source = SETTINGS.read_text()
    sections = [
        (number, match.group(1))
        for number, line in enumerate(source.splitlines(), 1)
        if (match := re.match(r"# --- (.+?) -+$", line))
    ]
    found: list[tuple[int, Setting]] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        section = next((t for n, t in reversed(sections) if n < node.lineno), "Django")
        if node.func.id == "setting":
            name, default, reason = node.args
            setting = Setting(
                section, ast.literal_eval(name), _default(default), ast.literal_eval(reason)
            )
            found.append((node.lineno, setting))
        elif node.func.id == "machinery":
            key, why = ast.literal_eval(node.args[0]), ast.literal_eval(node.args[2])
            shown = _default(ast.Constant(MACHINERY[key].default))
            found.append((node.lineno, Setting(section, key, shown, why)))
        elif node.func.id == "_secret":
            reason = next(k.value for k in node.keywords if k.arg == "reason")
            required = "**required** unless `DJANGO_DEBUG` is on"
            setting = Setting(
                section, ast.literal_eval(node.args[0]), required, ast.literal_eval(reason)
            )
            found.append((node.lineno, setting))
    return [setting for _, setting in sorted(found)]


def edge() -> list[Setting]:
    """The header of render.sh: ``#   NAME   default: reason``, continued on indented lines."""
    block = RENDER.read_text().split("# Settings (empty counts as unset):\n", 1)[1]
    found: list[list[str]] = []
    for line in block.split("\nset -eu", 1)[0].splitlines():
        if match := re.match(r"#   ([A-Z][A-Z0-9_]+)\s+(.*)", line):
            found.append([match.group(1), match.group(2)])
        elif found and (match := re.match(r"#\s{4,}(\S.*)", line)):
            found[-1][1] += " " + match.group(1)
    settings = []
    for name, text in found:
        default, _, reason = text.partition(": ")
        settings.append(Setting("The edge (nginx, deploy/nginx/render.sh)", name, default, reason))
    return settings


def declared() -> list[Setting]:
    """Every operator setting once (one the app and the edge both read is the app's)."""
    app = application()
    names = {s.name for s in app}
    library = [Setting("Read by a library", n, d, r) for n, (d, r) in LIBRARY.items()]
    return app + library + [s for s in edge() if s.name not in names]


def render() -> str:
    lines = [INTRO]
    section = None
    for s in declared():
        if s.section != section:
            section = s.section
            lines += ["", f"## {section}", "", "| Setting | Default | Why |", "|---|---|---|"]
        lines.append(f"| `{s.name}` | {s.default} | {s.reason} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    text = render()
    if parser.parse_args().check:
        if DOC.read_text() != text:
            print(f"out of date: {DOC.relative_to(ROOT)}: python -m scripts.configuration_doc")
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
