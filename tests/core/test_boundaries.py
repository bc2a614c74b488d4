"""``core`` is the machinery every job shares and names no domain: none of its modules imports
``invoicing`` or ``webhooks`` or spells one of their task names; what flows back from a domain
(what a dead letter is about, a probe for the dashboard, a health check, a metrics source)
comes through a registry the domain fills in its ``AppConfig.ready()``.

Project wiring (settings, the URL confs, the Celery app) may name the apps. The modules that
still name a domain are listed here, each with why, until the machinery moves into an app of
its own; the list may only shrink: a new module naming a domain fails, and so does a listed
one that no longer does (take it off the list)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from stack.process import ROOT

DOMAINS = ("invoicing", "webhooks")
WIRING = {"core/settings.py", "core/urls.py", "core/api_urls.py", "core/celery.py"}
STILL_NAMING_A_DOMAIN = {
    # The schedules of invoicing's jobs, and the retention of webhook events.
    "core/jobs.py",
    # The routes of invoicing's tasks to the email queue.
    "core/queues.py",
}
# A task name (or dotted module path) of a domain: "invoicing.send_invoice_email".
_DOMAIN_NAME = re.compile(rf"\b(?:{'|'.join(DOMAINS)})\.[a-z_][a-z0-9_.]*")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings: prose may mention a domain."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def domain_names(source: str) -> list[str]:
    """What in ``source`` names a domain: imports of its modules, and string constants (not
    docstrings, not comments) spelling one of its dotted names."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named += [a.name for a in node.names if a.name.split(".")[0] in DOMAINS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in DOMAINS:
                named.append(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            named += _DOMAIN_NAME.findall(node.value)
    return named


def core_modules() -> list[Path]:
    return sorted(
        path
        for path in (ROOT / "core").rglob("*.py")
        if "migrations" not in path.parts and path.relative_to(ROOT).as_posix() not in WIRING
    )


def test_the_check_finds_imports_and_task_names_but_not_prose() -> None:
    assert domain_names("from invoicing.models import Invoice") == ["invoicing.models"]
    assert domain_names("import webhooks.services") == ["webhooks.services"]
    assert domain_names("def f():\n    from invoicing import mail\n") == ["invoicing"]
    assert domain_names('TASK = "invoicing.send_invoice_email"') == ["invoicing.send_invoice_email"]
    assert domain_names('x = {"webhooks.reprocess": 1}') == ["webhooks.reprocess"]
    assert domain_names('"""Registered by ``invoicing.apps``."""\n# invoicing.mail\n') == []
    assert domain_names('NAME = "invoicing_dlq_depth"\nfrom core import probes') == []


def test_core_names_no_domain_but_through_its_registries() -> None:
    naming = {
        path.relative_to(ROOT).as_posix(): names
        for path in core_modules()
        if (names := domain_names(path.read_text()))
    }
    assert set(naming) == STILL_NAMING_A_DOMAIN, naming


def test_core_templates_name_no_domain() -> None:
    for template in (ROOT / "core" / "templates").rglob("*.html"):
        text = template.read_text()
        assert not re.search(r"invoic|webhook", text, re.IGNORECASE), template
