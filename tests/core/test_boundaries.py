"""The machinery (``asyncwork``, its operators' plumbing included) names no domain:
none of their modules imports ``invoicing`` or ``webhooks`` or spells one of their task names;
what flows back from a domain (its jobs, queues and routes, what a dead letter is about, a
probe, a health check, a metrics source, a retention rule, a webhook handler) comes through a
registry the domain fills in its ``AppConfig.ready()``. import-linter checks the imports in
``make test`` (``[tool.importlinter]``); this also catches a task name spelt in a string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from stack.process import ROOT

DOMAINS = ("invoicing", "webhooks")
# Their source directories: the machinery is a distribution of its own.
MACHINERY = ("packages/asyncwork/asyncwork",)
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


def machinery_modules() -> list[Path]:
    return sorted(
        path
        for app in MACHINERY
        for path in (ROOT / app).rglob("*.py")
        if "migrations" not in path.parts
    )


def test_the_check_finds_imports_and_task_names_but_not_prose() -> None:
    assert domain_names("from invoicing.models import Invoice") == ["invoicing.models"]
    assert domain_names("import webhooks.services") == ["webhooks.services"]
    assert domain_names("def f():\n    from invoicing import mail\n") == ["invoicing"]
    assert domain_names('TASK = "invoicing.send_invoice_email"') == ["invoicing.send_invoice_email"]
    assert domain_names('x = {"webhooks.reprocess": 1}') == ["webhooks.reprocess"]
    assert domain_names('"""Registered by ``invoicing.apps``."""\n# invoicing.mail\n') == []
    assert domain_names('NAME = "invoicing_dlq_depth"\nfrom asyncwork import probes') == []


def test_the_machinery_names_no_domain_but_through_its_registries() -> None:
    modules = machinery_modules()
    assert len(modules) > 20  # the check reads the apps it means to
    naming = {
        path.relative_to(ROOT).as_posix(): names
        for path in modules
        if (names := domain_names(path.read_text()))
    }
    assert naming == {}


def test_the_machinery_templates_name_no_domain() -> None:
    templates = [
        t for app in MACHINERY for t in (ROOT / app).rglob("*.html") if "templates" in t.parts
    ]
    assert templates
    for template in templates:
        text = template.read_text()
        assert not re.search(r"invoic|webhook", text, re.IGNORECASE), template
