"""Where the tests' own code lives: helpers in one package (``tests/helpers``), fixtures in
``conftest.py``, and no test module importing from ``conftest.py`` or from another test module,
so each can be read, moved or deleted alone. Beside them only the test settings and the tasks
loaded into test workers."""

from __future__ import annotations

import ast
from pathlib import PurePath

from tests.helpers.source import imported_modules, module_name, parsed, python_files

# Modules of tests/ that are neither tests, fixtures nor helpers, and why they are not helpers.
OTHERS = {
    "tests/settings.py": "the Django settings module of the test run",
    "tests/tasks.py": "tasks a worker process loads with --include tests.tasks",
}


def is_test_module(module: str) -> bool:
    return module.rpartition(".")[2].startswith("test_") or module.endswith(".conftest")


def test_no_test_module_imports_from_conftest_or_another_test_module() -> None:
    tests = python_files("tests")
    test_modules = {module_name(path) for path in tests if is_test_module(module_name(path))}
    found = [
        f"{path}:{line} imports {module}"
        for path in tests
        for line, module in imported_modules(path)
        if module in test_modules or module == "conftest"
    ]
    assert found == []
    assert "tests.conftest" in test_modules  # the check knows what it looks for


def test_helpers_live_in_the_helpers_package() -> None:
    misplaced = [
        path
        for path in python_files("tests")
        if not PurePath(path).name.startswith("test_")
        and PurePath(path).name not in {"conftest.py", "__init__.py"}
        and not path.startswith("tests/helpers/")
        and path not in OTHERS
    ]
    assert misplaced == []


def test_conftest_holds_fixtures_only() -> None:
    """Every function in a conftest.py is a fixture or a pytest hook (a helper it needs comes
    from helpers)."""
    for path in python_files("tests"):
        if PurePath(path).name != "conftest.py":
            continue
        for node in parsed(path).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("pytest_"):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                assert any(d.startswith("pytest.fixture") for d in decorators), (path, node.name)
            assert not isinstance(node, ast.ClassDef | ast.Assign | ast.AnnAssign), (
                path,
                ast.unparse(node)[:80],
            )
