"""The repository's own Python source, parsed, for the tests that check where things live."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from stack.process import ROOT

# The tools around the application, where a second way of starting a process would creep in.
TOOLS = ("bench", "chaos", "scripts", "stack", "tests")


def python_files(*folders: str) -> list[str]:
    """The tracked and new (not ignored) ``.py`` files under ``folders``, relative to the
    repository's root."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(path for path in set(listed) if path.endswith(".py") and (ROOT / path).exists())


@cache
def parsed(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), filename=path)


def module_name(path: str) -> str:
    return ".".join(Path(path).with_suffix("").parts).removesuffix(".__init__")


def imported_modules(path: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file: ``from a.b import c`` gives ``a.b`` and
    ``a.b.c`` (``c`` may be a module); ``import a.b`` gives ``a.b``."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def string_constants(node: ast.AST) -> set[str]:
    """Every string literal in ``node``'s subtree."""
    return {
        child.value
        for child in ast.walk(node)
        if isinstance(child, ast.Constant) and isinstance(child.value, str)
    }


def command_lines(path: str) -> Iterator[tuple[int, set[str]]]:
    """(line, words) of every list or tuple display that holds an option (a word starting with
    ``-``: every command line that starts a daemon has one, a tuple of names does not), and of
    every program looked up on the PATH (``shutil.which(...)``), the words being the string
    literals inside it: where a command line is written down."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Call):
            if _called(node) == "which":
                yield node.lineno, string_constants(node)
        elif isinstance(node, ast.List | ast.Tuple):
            words = string_constants(node)
            if any(word.startswith("-") for word in words):
                yield node.lineno, words


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def functions_defined(path: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.lineno, node.name


def calls_named(path: str, *names: str) -> Iterator[int]:
    """Lines that call a function or method with one of ``names`` (``os.killpg``,
    ``killpg``...), or pass a keyword argument of one of them (``start_new_session=``)."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Call) and (
            _called(node) in names or any(k.arg in names for k in node.keywords)
        ):
            yield node.lineno
