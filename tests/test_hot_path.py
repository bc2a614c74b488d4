"""The hot path as docs/explanation/architecture.md lists it ("The hot path") is the code's: at
most 15 modules from the webhook view to the SMTP server, each step's functions defined where
the list says, and each crossing one "go to definition" can follow (an import of the module), or
one of the declared ones, checked here: the event's handler (``@webhook_handler``), the task's
backend (Django's ``TASKS``), the one Celery task name on the wire (``asyncwork.run``) and the
job's task, found by its module path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 15
STEP = re.compile(r"^\d+\. `(?P<file>[\w/]+\.py)`: (?P<names>.+?)(?: \((?P<how>[^)]*)\))?$")


def steps() -> list[tuple[str, list[str], str]]:
    text = (ROOT / "docs/explanation/architecture.md").read_text()
    listed = text.split("<!-- hot-path:start -->")[1].split("<!-- hot-path:end -->")[0]
    found = []
    for line in listed.strip().splitlines():
        match = STEP.match(line)
        assert match, line
        names = re.findall(r"`([\w.]+)`", match["names"])
        found.append((match["file"], names, match["how"] or ""))
    return found


def tree(file: str) -> ast.Module:
    return ast.parse((ROOT / file).read_text())


def defined(file: str) -> set[str]:
    """Every function and class of ``file``, with ``Class.method`` for methods."""
    names: set[str] = set()
    for node in tree(file).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef)
            }
    return names


def imports(file: str) -> set[str]:
    """The application modules ``file`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(tree(file)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def module(file: str) -> str:
    # The machinery's files are under its distribution's directory (packages/asyncwork).
    return file.removeprefix("packages/asyncwork/").removesuffix(".py").replace("/", ".")


def test_the_hot_path_crosses_at_most_fifteen_modules_each_by_a_crossing_one_can_follow() -> None:
    path = steps()
    files = [file for file, _, _ in path]
    assert files[0] == "webhooks/views.py"
    assert "EmailBackend" in path[-1][1]
    assert len(set(files)) <= LIMIT, files

    for index, (file, names, how) in enumerate(path):
        missing = set(names) - defined(file)
        assert not missing, f"{file} defines no {missing}"
        if index == 0:
            continue
        origins = [int(n) - 1 for n in re.findall(r"\d+", how)] or [index - 1]
        for origin in origins:
            source = files[origin]
            if how.startswith("import"):
                assert module(file) in imports(source), f"{source} does not import {file}"
            elif how.startswith("the handler"):
                assert "webhooks.events.webhook_handler" in imports(file), file
            elif how.startswith("the task's backend"):
                # ``.enqueue()`` of a task of ``source`` reaches the backend TASKS names.
                assert "django_tasks.task" in imports(source), source
                backend = f"{module(file)}.{names[0].partition('.')[0]}"
                assert f'"BACKEND": "{backend}"' in (ROOT / "core/settings.py").read_text()
            elif how.startswith("the task name"):
                # Published under the one name on the wire by ``source``; the task that runs
                # every job takes that very constant as its name.
                assert re.search(r"\bsend_task\(\s*RUN\b", (ROOT / source).read_text()), source
                assert re.search(r"name=RUN\b", (ROOT / file).read_text()), file
            elif how.startswith("the job's task"):
                # ``source`` finds the task by the module path the job row holds: the function,
                # a ``@task`` of ``file``, is that path.
                assert "asyncwork.tasks.task_for" in imports(source), source
                for name in names:
                    assert f"@task(**_EMAIL)\ndef {name}(" in (ROOT / file).read_text(), name
            else:
                raise AssertionError(f"step {index + 1}: no crossing named ({how!r})")


def test_the_one_name_on_the_wire_is_declared_once_and_no_task_is_named_by_a_string() -> None:
    """Pass the thing, not its name: a task is enqueued as the object (its module path is its
    name), and the one Celery task name every job's message carries is a constant of its own."""
    apps = ("core", "packages/asyncwork/asyncwork", "operators", "invoicing", "webhooks")
    sources = {
        str(path.relative_to(ROOT)): path.read_text()
        for app in apps
        for path in (ROOT / app).rglob("*.py")
        if "migrations" not in path.parts
    }
    assert [path for path, text in sources.items() if '"asyncwork.run"' in text] == [
        "packages/asyncwork/asyncwork/tasks.py"
    ]
    assert [path for path, text in sources.items() if '"invoicing.tasks.' in text] == []
