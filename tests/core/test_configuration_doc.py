"""docs/reference/settings.md is what the declarations in the code make, and the edge's declared
settings are the ones render.sh reads."""

from __future__ import annotations

import ast

from scripts import configuration_doc
from stack.nginx import setting_names


def test_the_doc_is_what_the_declarations_make() -> None:
    # Out of date: regenerate with python -m scripts.configuration_doc
    assert configuration_doc.DOC.read_text() == configuration_doc.render()


def test_every_operator_setting_is_declared_once_with_a_default_and_a_reason() -> None:
    declared = configuration_doc.declared()
    names = [s.name for s in declared]
    assert len(names) == len(set(names)), "declared twice"
    for setting in declared:
        assert setting.default, setting
        assert setting.reason, setting


def test_the_edge_declares_exactly_what_render_sh_reads() -> None:
    declared = {s.name for s in configuration_doc.edge()}
    # The template uses these and the names render.sh derives from them, nothing else
    # (tests/webhooks/test_edge.py).
    assert declared == set(setting_names())


def test_the_application_reads_at_most_60_settings_and_nothing_undeclared() -> None:
    """The settings an operator gives the application (core/settings.py, and the one its
    metrics library reads); the edge's are nginx's, declared in render.sh's header."""
    assert len(configuration_doc.application()) <= 60
    # Every environment read goes through setting(), _secret() or machinery(): none bypasses
    # the doc.
    tree = ast.parse(configuration_doc.SETTINGS.read_text())
    readers = {"setting", "_secret", "machinery"}
    inside = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and function.name in readers
        for node in ast.walk(function)
    }
    bypasses = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "env"
        and node.attr != "db_url_config"  # parses DATABASE_URL, which setting() read
        and id(node) not in inside
    ]
    assert bypasses == [], "read these through setting(...) or machinery(...)"
